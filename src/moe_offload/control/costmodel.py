"""The cost model: a calibrated roofline that predicts decode ms/token of a placement under a miss policy.

    Calibration (`moe-offload calibrate`, assumed, or a hardware.py profile) --+
    ModelSpec + Placement + miss policy (+ profile | hit rates)  -------------+--> predict --> Prediction (ms/token, breakdown)
    choose = argmin of predict over miss policies x placement policies at the slots that fit  (`plan --policy auto`)

One decode step of T tokens, per MoE layer (K top-k, E experts, u = distinct experts the step routes to,
n = T*K/u tokens per expert, h = accelerator hit rate under the policy):

    expert(n) on a side = max(expert bytes / expert bandwidth, 2 * expert params * n / expert flops)   (roofline)
    hits            u*h      x expert(n) on the device
    misses          u*(1-h)  x  static: expert(n) on the host
                                lru:    expert bytes / bus bandwidth (fetch) + expert(n) on the device
                                hybrid: lru's cost when n >= threshold, else static's
    CUDA overlaps the host's misses with the device's work (max); on a CPU "device" they add up.
    + dense weights (attention, norms, routers, shared experts, LM head) / device GEMV bandwidth
    + KV cache read / device read bandwidth  + per-layer fixed overhead x layers + per-step fixed overhead
    disk tier (host_slots C per layer, the rest of the experts in the expert store file): of the experts a layer
    asks the host for, a share g (the host tier's hit rate: given, Che's LRU approximation on the profile's
    counts, else C/E) is in memory; the others are read:  u*(1-h)*(1-g) x expert bytes / disk read bandwidth,
    overlapping the compute of the g in memory (the engine computes those while the reads run)

Every number a Prediction carries is labelled predicted; every Calibration field says whether it was
measured (where, when, how) or assumed. Pure Python: no torch, no numpy at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from moe_offload.control.calibration import Calibration, load_calibration
from moe_offload.control.hitrates import _host_name, _layer_split, host_tier_rates, layer_hit_rates
from moe_offload.control.vocab import EXPERT_DTYPE_BYTES, MISS_POLICIES
from moe_offload.errors import ConfigError, PlacementError

NEVER = 1 << 30  # hybrid threshold when fetching never pays (hybrid then acts as static)
_MAX_SEARCH = 1 << 16


def expert_bytes_per_param(expert_dtype) -> float:
    """Bytes per expert parameter of ``expert_dtype``: a name of ``EXPERT_DTYPE_BYTES`` or a number > 0."""
    if isinstance(expert_dtype, str):
        if expert_dtype not in EXPERT_DTYPE_BYTES:
            raise ConfigError(f"expert dtype: expected one of {', '.join(EXPERT_DTYPE_BYTES)} or bytes per parameter, "
                              f"got {expert_dtype!r}")
        return EXPERT_DTYPE_BYTES[expert_dtype]
    v = expert_dtype
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 8:
        raise ConfigError(f"expert dtype: expected a name or bytes per parameter in (0, 8], got {v!r}")
    return float(v)


# ---- the roofline ---------------------------------------------------------------------------------------


def expert_ms(cal: Calibration, side: str, expert_bytes: int, expert_params: int, tokens: float) -> float:
    """ms of one expert over ``tokens`` tokens on ``side`` ("device" | "host"): max(memory, compute)."""
    bw = cal.value(f"{side}_expert_bytes_per_s")
    flops = cal.value(f"{side}_expert_flops_per_s")
    return 1000 * max(expert_bytes / bw, 2 * expert_params * tokens / flops)


def fetch_ms(cal: Calibration, expert_bytes: int) -> float:
    return 1000 * expert_bytes / cal.value("bus_bytes_per_s")


def hybrid_threshold(cal: Calibration, expert_bytes: int, expert_params: int) -> int:
    """Smallest tokens-per-expert n at which fetching (bus + device compute) costs no more than host compute;
    ``NEVER`` when fetching never pays (on a CPU "accelerator" the host is the same cores)."""
    lo = None
    n = 1
    while n <= _MAX_SEARCH:  # host(n) - device(n) grows with n here, so the first crossing is found by doubling
        if _fetch_pays(cal, expert_bytes, expert_params, n):
            lo = n
            break
        n *= 2
    if lo is None:
        return NEVER
    a = max(1, lo // 2)
    while a < lo:  # bisect the last doubling step
        mid = (a + lo) // 2
        if _fetch_pays(cal, expert_bytes, expert_params, mid):
            lo = mid
        else:
            a = mid + 1
    return lo


_threshold = hybrid_threshold  # predict() takes a hybrid_threshold argument of the same name


def _fetch_pays(cal, nbytes, params, n) -> bool:
    return fetch_ms(cal, nbytes) + expert_ms(cal, "device", nbytes, params, n) <= expert_ms(cal, "host", nbytes, params, n)


# ---- hit rates --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Predicted (never measured) time of one decode step; ms are per generated token."""

    policy: str
    placement_policy: str
    tokens: int
    ms_per_token: float
    device_experts_ms: float
    host_experts_ms: float
    fetch_ms: float
    dense_ms: float
    overhead_ms: float
    overlap_ms: float  # host work hidden behind the accelerator's (CUDA), and reads behind compute; subtracted
    accelerator_hit_rate: float
    hit_rate_source: str
    fetches_per_token: float
    bytes_moved_per_token: float
    hybrid_threshold: int | None
    calibration: str
    calibration_sources: Mapping[str, str] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()
    label: str = "predicted"
    disk_ms: float = 0.0  # reading experts from the disk tier (before the overlap)
    host_tier_hit_rate: float | None = None  # the disk tier's: share of asked-for experts already in host memory
    disk_bytes_per_token: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000 / self.ms_per_token if self.ms_per_token > 0 else float("inf")

    def breakdown(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("device_experts_ms", "host_experts_ms", "fetch_ms", "disk_ms", "dense_ms",
                                              "overhead_ms", "overlap_ms")}

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["calibration_sources"] = dict(self.calibration_sources)
        d["assumptions"] = list(self.assumptions)
        return d

    def text(self) -> str:
        b = self.breakdown()
        parts = ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {v:.3f}" for k, v in b.items() if v)
        thr = ""
        if self.policy == "hybrid" and self.hybrid_threshold is not None:
            thr = f", hybrid threshold {'never' if self.hybrid_threshold >= NEVER else self.hybrid_threshold} tokens"
        return (f"predicted {self.ms_per_token:.3f} ms/token ({self.tokens_per_s:.1f} tok/s) with {self.policy} misses "
                f"on placement {self.placement_policy}: {parts or 'nothing'} ms; predicted hit rate "
                f"{self.accelerator_hit_rate:.1%} ({self.hit_rate_source}){thr}")


def _distinct(E: int, K: int, T: int) -> float:
    """Expected distinct experts T tokens route to (K each, uniform routing)."""
    return E * (1 - (1 - K / E) ** T) if T > 1 else float(K)


def predict(spec, placement, policy: str, calibration: Calibration, *, hit_rates=None, profile=None, tokens: int = 1,
            context: int = 0, hybrid_threshold: int | None = None, expert_dtype=None, host_slots: int | None = None,
            host_hit_rate: float | None = None) -> Prediction:
    """Predicted ms/token of a decode step of ``tokens`` tokens (1 = plain decode) with ``placement``
    under miss ``policy`` (static | lru | hybrid) on ``calibration``'s machine.

    Hit rate: ``hit_rates`` (a fraction 0..1 for the accelerator, or {tier: fraction} with the host
    tier's share as the misses: e.g. measured, or replayed by placement.simulate) if given, else from
    ``profile``, else uniform routing. ``context``: tokens already in the KV cache (read every step).
    ``hybrid_threshold``: tokens per expert from which hybrid fetches (default: from the calibration).
    ``expert_dtype``: the routed experts' stored format (a name of ``EXPERT_DTYPE_BYTES`` or bytes per parameter),
    when it differs from the config's dtype; the dense weights keep the config's. ``host_slots``: experts per layer
    host memory holds when the rest live on disk (the disk tier); ``host_hit_rate``: its hit rate, if known
    (measured), else predicted by ``host_tier_rates``.
    """
    if policy not in MISS_POLICIES:
        raise ConfigError(f"policy: expected one of {', '.join(MISS_POLICIES)}, got {policy!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(f"tokens: expected an integer >= 1, got {tokens!r}")
    cal = load_calibration(calibration)
    moe = tuple(lp.layer for lp in placement.layers)
    if moe != spec.moe_layers or any(lp.num_experts != spec.num_experts for lp in placement.layers):
        raise PlacementError(f"placement of {placement.model} ({len(moe)} MoE layers x "
                             f"{placement.layers[0].num_experts if placement.layers else 0} experts) does not fit "
                             f"{spec.name} ({spec.num_moe_layers} MoE layers x {spec.num_experts} experts)")
    assumptions = []
    E, K, T = spec.num_experts, spec.top_k, tokens
    nbytes, params = spec.expert_bytes, spec.expert_params
    if expert_dtype is not None:
        bpp = expert_bytes_per_param(expert_dtype)
        nbytes = round(params * bpp)
        assumptions.append(f"experts stored as {expert_dtype}: {bpp:g} bytes/parameter, {nbytes} bytes per expert")
    measured_at = cal.expert_shape.get("expert_bytes")
    if measured_at and abs(measured_at - nbytes) > 0.05 * nbytes:
        assumptions.append(f"expert kernel measured at {measured_at} bytes/expert, model has {nbytes}: scaled by bytes")

    host = _host_name(placement)
    split = _layer_split(placement, host)
    if hit_rates is not None:
        h = _override_rate(hit_rates, host)
        rates, source = [h] * len(split), "given"
    else:
        rates, source = layer_hit_rates(spec, placement, policy, profile)
    threshold = None
    if policy == "hybrid":
        threshold = hybrid_threshold if hybrid_threshold is not None else _threshold(cal, nbytes, params)

    u = _distinct(E, K, T)  # experts one layer runs this step
    n = T * K / u  # tokens per expert
    dev_one = expert_ms(cal, "device", nbytes, params, n)
    host_one = expert_ms(cal, "host", nbytes, params, n)
    fetch_one = fetch_ms(cal, nbytes)
    act_ms = 0.0
    if cal.overlaps_host:  # activations to the host and outputs back: 2 x n x H per host-computed expert
        act_ms = 1000 * 2 * n * spec.hidden_size * spec.dtype_bytes / cal.value("bus_bytes_per_s")
    dev_t = host_t = fetch_t = overlap = fetches = disk_t = reads = 0.0
    grates = None
    if host_slots is not None:
        grates = ([host_hit_rate] * len(split) if host_hit_rate is not None
                  else host_tier_rates(spec, placement, host_slots, profile))
    for li, ((pinned, dyn), h) in enumerate(zip(split, rates)):
        hits, misses = u * h, u * (1 - h)
        fetch = dyn > 0 and (policy == "lru" or (policy == "hybrid" and n >= threshold))
        ld, lf, lh = hits * dev_one, 0.0, 0.0
        if fetch:
            lf = misses * fetch_one
            ld += misses * dev_one
            fetches += misses
        else:
            lh = misses * (host_one + act_ms)
        if cal.overlaps_host:
            overlap += min(ld + lf, lh)
        if grates is not None:  # the experts asked of host memory that are on disk are read first
            g = grates[li]
            n_read = misses * (1 - g)
            ldisk = 1000 * n_read * nbytes / cal.value("disk_read_bytes_per_s")
            overlap += min(ldisk, (lh + lf) * g)  # reads run while the experts already in memory compute
            disk_t, reads = disk_t + ldisk, reads + n_read
        dev_t, fetch_t, host_t = dev_t + ld, fetch_t + lf, host_t + lh
    if policy != "static" and any(d == 0 for _, d in split):
        assumptions.append("layers without dynamic slots compute their misses on the host")
    if policy == "hybrid":
        assumptions.append("hybrid's dynamic slots are predicted like LRU slots (filled by fetches of wide steps)")

    dense_bytes = spec.dense_bytes + spec.lm_head_bytes + spec.hidden_size * spec.dtype_bytes  # + one embedding row
    if spec.tie_word_embeddings:
        dense_bytes += spec.embedding_bytes  # the LM head reads the tied table
    dense = 1000 * dense_bytes / cal.value("device_gemv_bytes_per_s")
    if context:
        dense += 1000 * spec.kv_cache_bytes(context) / cal.value("device_read_bytes_per_s")
    if T > 1:
        assumptions.append(f"dense weights memory-bound at {T} tokens per step")
    overhead = cal.value("layer_overhead_ms") * spec.num_layers + cal.value("step_overhead_ms")
    if source.startswith("uniform"):
        assumptions.append("routing uniform over experts (no profile)")
    if grates is not None:
        assumptions.append(f"disk tier: {host_slots} host slots per layer, host hit rate "
                           f"{'given' if host_hit_rate is not None else 'predicted (' + ('profile' if profile is not None else 'uniform routing') + ')'}"
                           f"; reads overlap the in-memory experts' compute, not each other's wait")
    total = dev_t + host_t + fetch_t + disk_t + dense + overhead - overlap
    per = 1.0 / T
    return Prediction(
        policy=policy, placement_policy=placement.policy, tokens=T, ms_per_token=total * per,
        device_experts_ms=dev_t * per, host_experts_ms=host_t * per, fetch_ms=fetch_t * per, dense_ms=dense * per,
        overhead_ms=overhead * per, overlap_ms=-overlap * per,
        accelerator_hit_rate=sum(rates) / len(rates) if rates else 0.0, hit_rate_source=source,
        fetches_per_token=fetches * per, bytes_moved_per_token=fetches * nbytes * per, hybrid_threshold=threshold,
        calibration=cal.label(), calibration_sources=cal.sources(), assumptions=tuple(assumptions),
        disk_ms=disk_t * per, disk_bytes_per_token=reads * nbytes * per,
        host_tier_hit_rate=sum(grates) / len(grates) if grates else None)


def _override_rate(hit_rates, host: str) -> float:
    if isinstance(hit_rates, Mapping):
        if host in hit_rates:
            v = 1.0 - float(hit_rates[host])
        else:
            v = float(sum(hit_rates.values()))
    else:
        v = hit_rates
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 + 1e-9:
        raise ConfigError(f"hit_rates: expected a fraction 0..1 (or {{tier: fraction}}), got {hit_rates!r}")
    return min(1.0, float(v))


# ---- choose -----------------------------------------------------------------------------------------------


def default_candidates(slots: int, profile=None) -> list[tuple[str, str]]:
    """(miss policy, placement policy) pairs worth predicting with ``slots`` slots per layer."""
    out = [("static", "top")]
    if profile is not None:
        out.append(("static", "global"))
    if slots > 0:
        out.append(("lru", "lru"))
        for h in sorted({slots // 4, slots // 2, (3 * slots) // 4} - {0, slots}):
            out += [("lru", f"mix:{h}"), ("hybrid", f"mix:{h}")]
        out.append(("hybrid", "lru"))
    return out


def rank(spec, tiers: Sequence, profile, calibration, candidates=None, *, slots: Mapping[str, Any] | None = None,
         context: int = 4096, batch: int = 1, reserve: int | str = 0, tokens: int = 1, seed: int = 0,
         expert_dtype=None):
    """Every candidate as (policy, Placement, Prediction), fastest first (ties keep candidate order).
    ``expert_dtype``: as in ``predict`` (prices the predicted experts; slot sizing stays the budget's)."""
    from moe_offload.control import placement as P

    cal = load_calibration(calibration)
    if slots is None:
        from moe_offload.control.budget import plan_budget

        host_name = P.host_tier_name(tiers)
        host = next((t for t in tiers if t.name == host_name), None)
        slots = plan_budget(spec, P.accelerator_tiers(tiers), context=context, batch=batch, reserve=reserve,
                            host=host).slots
    # slots per layer over all accelerators (a per-layer list counts its largest layer)
    per_layer = sum(v if isinstance(v, int) else max(v, default=0) for v in slots.values())
    if candidates is None:
        # with every expert in a slot nothing misses: the policies cannot differ
        candidates = default_candidates(per_layer, profile) if per_layer < spec.num_experts else [("static", "top")]
    results = []
    for cand in candidates:
        policy, placement_policy = cand.split("/", 1) if isinstance(cand, str) else cand
        if policy not in MISS_POLICIES:
            raise ConfigError(f"candidate {cand!r}: miss policy must be one of {', '.join(MISS_POLICIES)}")
        placement = P.plan(spec, tiers, slots, placement_policy, profile, seed)
        # KV-cache reads are the same for every candidate: predicted at an empty context
        pred = predict(spec, placement, policy, cal, profile=profile, tokens=tokens, expert_dtype=expert_dtype)
        results.append((policy, placement, pred))
    if not results:
        raise ConfigError("choose: no candidates")
    order = sorted(range(len(results)), key=lambda i: (round(results[i][2].ms_per_token, 9), i))
    return [results[i] for i in order]


def choose(spec, tiers: Sequence, profile, calibration, candidates=None, **kw):
    """The fastest predicted (miss policy, Placement, Prediction) over ``candidates`` (default:
    ``default_candidates``) at the slots that fit (``slots=`` or sized by ``budget.plan_budget``)."""
    return rank(spec, tiers, profile, calibration, candidates, **kw)[0]


__all__ = ["NEVER", "Prediction", "choose", "default_candidates", "expert_bytes_per_param", "expert_ms", "fetch_ms",
           "hybrid_threshold", "layer_hit_rates", "predict", "rank"]
