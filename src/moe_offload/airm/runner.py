"""The ai-rm adapter: the workload runner ``airm.workloads:npu-offload``.

    registry.load("airm.workloads", "npu-offload") -> run
    run(Workload(kind="decode"), **config) -> [Measurement]       (KPI decode runs)
    run(Workload(kind="serve"), **config)  -> blocks, or a handle with .url and .stop() (block=False)

Importing this module opens no device, starts no engine and imports no torch.
"""

from __future__ import annotations

from typing import Any

from rm_core import ContractError, Measurement, MemoryTier, Workload
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


def log_tiers(tiers: list[MemoryTier], log) -> None:
    """One structured event per tier, at start-up."""
    for t in tiers:
        log.info(
            "memory_tier",
            tier=t.name,
            kind=t.kind,
            accelerator=t.accelerator,
            capacity_bytes=t.capacity_bytes,
            reserved_bytes=t.reserved_bytes,
        )


def engine_options(cfg) -> dict[str, Any]:
    """The backend's engine options from the runner config."""
    from moe_offload.backends import engine_options as options
    from moe_offload.control.units import parse_size

    kv = cfg.kv_cache_memory
    return options(cfg.backend_name or "", policy=cfg.policy, fraction=cfg.fraction, mock_ms=cfg.mock_ms,
                   mock_hit=cfg.mock_hit, engine=cfg.engine, data=cfg.data, env=cfg.env, max_num_seqs=cfg.max_num_seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
                   block_size=cfg.block_size, kv_cache_memory=parse_size(kv, "kv_cache_memory") if kv is not None else None,
                   expert_dtype=cfg.expert_dtype, dense_dtype=cfg.dense_dtype)


def build(cfg, log):
    """Pick the backend, log its tiers, build the engine. Returns (backend, engine, tiers, model)."""
    from moe_offload import backends
    from moe_offload.errors import OffloadError

    try:
        backend = backends.get_backend(cfg.backend_name) if cfg.backend_name else backends.best_available()
        backend.require()
        tiers = backend.tiers()
        log_tiers(tiers, log)
        model = cfg.model
        if not model and backend.name in ("cpu", "cuda"):
            from moe_offload.demo import ensure_demo_model

            model = str(ensure_demo_model())
        placement = None if cfg.placement in (None, "", "auto") else cfg.placement
        engine = backend.build_engine(model or "mock", placement, **engine_options(cfg))
    except OffloadError as e:
        # At the rm-core boundary every bad input is a ContractError.
        raise ContractError("config", "a configuration this machine can run", str(e)) from None
    log.info("engine_ready", backend=backend.name, model=engine.info.model, policy=engine.info.policy)
    return backend, engine, tiers, model or "mock"


def decode(workload: Workload, cfg) -> list[Measurement]:
    from moe_offload import log as logmod
    from moe_offload.airm.power import card_power_w
    from moe_offload.engines.base import SamplingParams
    from moe_offload.errors import OffloadError

    log = logmod.get_logger("moe_offload.airm.runner")
    if workload.model and not cfg.model:
        cfg = type(cfg)(**{**cfg.__dict__, "model": workload.model})
    backend, engine, _tiers, model = build(cfg, log)
    token_ms: list[float] = []
    decode_ms = 0.0
    hits = routed = 0
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
            log.info("decode_done", run=i, tokens=s.completion_tokens, decode_ms_per_token=round(s.decode_ms_per_token, 3))
    finally:
        engine.close()
    labels = {"model": model, "backend": backend.name, "policy": engine.info.policy or "none"}
    out = [
        Measurement("airm_tok_s", 1000 * len(token_ms) / decode_ms if decode_ms else 0.0, "tok/s", labels),
        Measurement("airm_tpot_p50_ms", percentile(token_ms, 0.5), "ms", labels),
        Measurement("airm_tpot_p90_ms", percentile(token_ms, 0.9), "ms", labels),
        Measurement("moe_offload_expert_hit_rate", hits / routed if routed else 0.0, "ratio", labels),
    ]
    power = card_power_w(backend.name)
    if power:
        out.append(Measurement("airm_power_w", sum(power.values()), "W", {**labels, "scope": "card"}))
    return out
