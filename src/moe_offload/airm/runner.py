"""The ai-rm adapter: the workload runner ``airm.workloads:npu-offload``.

    registry.load("airm.workloads", "npu-offload") -> run
    run(Workload(kind="decode"), **config) -> [Measurement]       (KPI decode runs)
    run(Workload(kind="serve"), **config)  -> blocks, or a handle with .url and .stop() (block=False)

Importing this module opens no device, starts no engine and imports no torch.
"""

from __future__ import annotations

from typing import Any

from rm_core import ContractError, Measurement, Workload
from rm_core.metrics import percentile


def run(workload: Workload, **config: Any):
    """Run ``workload`` with the runner config (keys: ``moe_offload.airm.config.RunConfig``)."""
    from moe_offload.airm.config import RunConfig

    if not isinstance(workload, Workload):
        raise ContractError("workload", "an rm_core.Workload", workload)
    cfg = RunConfig.parse(config)
    if workload.kind == "decode":
        return decode(workload, cfg)
    from moe_offload.airm.serve import serve

    return serve(workload, cfg)


def decode(workload: Workload, cfg) -> list[Measurement]:
    from moe_offload import log as logmod
    from moe_offload.airm.build import build
    from moe_offload.airm.power import card_power_w
    from moe_offload.engines.base import GenerationStats
    from moe_offload.engines.params import SamplingParams
    from moe_offload.errors import OffloadError

    log = logmod.get_logger("moe_offload.airm")
    if workload.model and not cfg.model:
        cfg = type(cfg)(**{**cfg.__dict__, "model": workload.model})
    backend, engine, _tiers, model = build(cfg, log)
    token_ms: list[float] = []
    decode_ms = 0.0
    hits = routed = 0
    total = GenerationStats()
    try:
        ids = engine.tokenizer.encode(cfg.prompt)
        params = SamplingParams(max_tokens=cfg.max_new, ignore_eos=True)
        try:
            engine.check_prompt(ids, params)
        except OffloadError as e:  # at the rm-core boundary every bad input is a ContractError
            field = "config.max_new" if "context length" in str(e) else "config.prompt"
            raise ContractError(field, "a decode that fits the engine", str(e)) from None
        for i in range(cfg.repeat):
            gen = engine.generate(ids, params)
            for _ in gen:
                pass
            s = gen.stats
            token_ms.extend(s.token_ms)
            decode_ms += s.decode_ms
            hits += s.hits
            routed += s.hits + s.misses
            total.add(s)
            log.info("decode_done", run=i, tokens=s.completion_tokens, decode_ms_per_token=round(s.decode_ms_per_token, 3))
    finally:
        engine.close()
    labels = {"model": model, "backend": backend.name, "policy": engine.info.policy or "none"}
    if engine.info.approximate:  # an opt-in approximate mode: every KPI says so
        labels["approximate"] = engine.info.approximate
    out = [
        Measurement("airm_tok_s", 1000 * len(token_ms) / decode_ms if decode_ms else 0.0, "tok/s", labels),
        Measurement("airm_tpot_p50_ms", percentile(token_ms, 0.5), "ms", labels),
        Measurement("airm_tpot_p90_ms", percentile(token_ms, 0.9), "ms", labels),
        Measurement("moe_offload_expert_hit_rate", hits / routed if routed else 0.0, "ratio", labels),
    ]
    disk = total.disk_summary()
    if disk:  # the disk tier: experts read from the expert store file into host memory
        out += [Measurement("moe_offload_disk_bytes_per_token", disk["disk_bytes_per_token"], "bytes", labels),
                Measurement("moe_offload_host_tier_hit_rate", disk["host_hit_rate"], "ratio", labels),
                Measurement("moe_offload_disk_stall_ms_per_token", disk["stall_ms_per_token"], "ms", labels),
                Measurement("moe_offload_prefetch_precision", disk["prefetch_precision"], "ratio", labels),
                Measurement("moe_offload_prefetch_recall", disk["prefetch_recall"], "ratio", labels)]
    power = card_power_w(backend.name)
    if power:
        out.append(Measurement("airm_power_w", sum(power.values()), "W", {**labels, "scope": "card"}))
    return out
