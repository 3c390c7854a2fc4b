"""Metric names every rm-core workload may report, with their units.

A metric is deprecated by setting ``deprecated_in``; it keeps being reported
until the next minor protocol version (PROTOCOL.md).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    help: str
    deprecated_in: str | None = None


METRICS: dict[str, MetricSpec] = {
    m.name: m
    for m in (
        MetricSpec("airm_tok_s", "tok/s", "decode throughput of one request, tokens per second"),
        MetricSpec("airm_tpot_p50_ms", "ms", "median time per output token (over decode steps: percentile())"),
        MetricSpec("airm_tpot_p90_ms", "ms", "90th percentile time per output token (over decode steps: percentile())"),
        MetricSpec("airm_power_w", "W", "accelerator card power draw"),
        MetricSpec(
            "moe_offload_expert_hit_rate",
            "ratio",
            "fraction 0..1 of routed token-expert pairs served from accelerator memory",
        ),
    )
}


def percentile(values, q: float) -> float:
    """The q-quantile (q in 0..1) of ``values``, linearly interpolated between closest ranks; 0.0 when empty.

    The estimator behind ``airm_tpot_p50_ms`` / ``airm_tpot_p90_ms``, over the wall times of the decode steps
    (one per output token after the first), so that every workload reports the same quantity.
    """
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
