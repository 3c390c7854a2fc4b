"""The ai-rm adapter: the workload runner ``airm.workloads:npu-offload``.

Importing this module opens no device, starts no engine and imports no torch.
"""

from __future__ import annotations

import statistics
from typing import Any

from rm_core import ContractError, Measurement, Workload

DECODE_KEYS = {"backend", "model", "placement", "prompt", "max_new", "repeat", "mock", "mock_ms", "mock_hit", "policy", "fraction"}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run(workload: Workload, **config: Any) -> list[Measurement]:
    """Run a Workload. ``decode`` returns Measurements of ``repeat`` decodes of ``prompt``."""
    if not isinstance(workload, Workload):
        raise ContractError("workload", "an rm_core.Workload", workload)
    unknown = sorted(set(config) - DECODE_KEYS)
    if unknown:
        raise ContractError(f"config.{unknown[0]}", "one of " + ", ".join(sorted(DECODE_KEYS)), unknown[0])
    if workload.kind != "decode":
        raise ContractError("Workload.kind", "decode (serve comes with the serving adapter)", workload.kind)
    return decode(workload, **config)


def decode(workload: Workload, **config: Any) -> list[Measurement]:
    from moe_offload import backends
    from moe_offload.engines.base import SamplingParams

    mock = config.get("mock") in (True, "1", "true")
    name = "mock" if mock else config.get("backend") or "mock"
    backend = backends.get_backend(name)
    backend.require()
    options: dict[str, Any] = {}
    if name == "mock":
        options = {"ms_per_token": float(config.get("mock_ms", 5.0)), "hit_rate": float(config.get("mock_hit", 0.85))}
    model = config.get("model") or workload.model or "mock"
    engine = backend.build_engine(model, config.get("placement"), **options)
    try:
        prompt = str(config.get("prompt", "Hello"))
        max_new, repeat = int(config.get("max_new", 32)), int(config.get("repeat", 1))
        if max_new < 1 or repeat < 1:
            raise ContractError("config.max_new/repeat", "integers >= 1", (max_new, repeat))
        ids = engine.tokenizer.encode(prompt)
        token_ms: list[float] = []
        decode_ms = 0.0
        hits = routed = 0
        for _ in range(repeat):
            gen = engine.generate(ids, SamplingParams(max_tokens=max_new, ignore_eos=True))
            for _tok in gen:
                pass
            token_ms.extend(gen.stats.token_ms)
            decode_ms += gen.stats.decode_ms
            hits += gen.stats.hits
            routed += gen.stats.hits + gen.stats.misses
    finally:
        engine.close()
    labels = {"model": model, "backend": name, "policy": engine.info.policy or "none"}
    tok_s = 1000 * len(token_ms) / decode_ms if decode_ms else 0.0
    return [
        Measurement("airm_tok_s", tok_s, "tok/s", labels),
        Measurement("airm_tpot_p50_ms", statistics.median(token_ms) if token_ms else 0.0, "ms", labels),
        Measurement("airm_tpot_p90_ms", _percentile(token_ms, 0.9), "ms", labels),
        Measurement("moe_offload_expert_hit_rate", hits / routed if routed else 0.0, "ratio", labels),
    ]
