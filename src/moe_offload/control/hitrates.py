"""Predicted hit rates of a placement: the accelerator's per MoE layer under a miss policy, and the host tier's when
the experts live on disk (host memory an LRU cache over the expert store). Pure Python; numpy only with a profile.

With a routing profile: pinned experts hit by their counts, LRU slots by Che's approximation over the rest; without
one, routing is taken as uniform (d/E for d slots).
"""

from __future__ import annotations


def _layer_split(placement, host: str):
    """Per layer: (pinned mask [E] as bools, dynamic slots on accelerators)."""
    below = {host} | {t.name for t in placement.tiers if t.kind == "disk"}  # on no accelerator
    out = []
    for lp in placement.layers:
        pinned = [h not in below for h in lp.home]
        dynamic = sum(max(0, lp.dynamic(t)) for t in lp.slots if t not in below)
        out.append((pinned, dynamic))
    return out


def _host_name(placement) -> str:
    from moe_offload.control.placement import host_tier_name

    return host_tier_name(placement.tiers) or placement.host_tier or placement.tiers[-1].name


def layer_hit_rates(spec, placement, policy: str, profile=None) -> tuple[list[float], str]:
    """Predicted accelerator hit rate per MoE layer under ``policy``, and where it comes from.

    Pinned experts hit exactly (profile counts, else uniform routing). Dynamic slots count only under
    lru/hybrid (static never fills them): Che's LRU approximation with a profile, d/E without one.
    """
    host = _host_name(placement)
    split = _layer_split(placement, host)
    E = spec.num_experts
    rates = []
    if profile is not None:
        from moe_offload.control.placement import _che_hits

        np = _np()
        for li, (pinned, dyn) in enumerate(split):
            counts = profile.counts[li].astype(np.float64)
            total = float(counts.sum())
            if total == 0:
                rates.append(0.0)
                continue
            mask = np.array(pinned)
            hits = float(counts[mask].sum())
            if dyn and policy != "static":
                hits += _che_hits(counts[~mask], dyn)
            rates.append(min(1.0, hits / total))
        return rates, f"profile {profile.source}" if getattr(profile, "source", None) else "profile"
    for pinned, dyn in split:
        p = sum(pinned)
        d = min(dyn, E - p) if policy != "static" else 0
        rates.append((p + d) / E)
    return rates, "uniform routing (no profile)"


def _np():
    import numpy as np

    return np


# ---- predict ----------------------------------------------------------------------------------------------


RECORD_ALIGN = 4096  # the expert store pads each expert's record to the page size (engines' diskstore.ALIGN)


def host_slots_for(spec, host_bytes: int) -> int:
    """Host expert slots per MoE layer in ``host_bytes``: each layer an equal share of records, rounded up to
    RECORD_ALIGN as the expert store holds them (as the engine counts them)."""
    record = -(-spec.expert_bytes // RECORD_ALIGN) * RECORD_ALIGN
    return host_bytes // (record * max(1, spec.num_moe_layers))


def host_tier_rates(spec, placement, host_slots: int, profile=None) -> list[float]:
    """Per MoE layer, the predicted share of the experts a layer asks host memory for (those not pinned on the
    accelerator) that are in its ``host_slots`` (pinned experts of a CPU accelerator included): Che's approximation on
    the profile's counts, else uniform routing."""
    host = _host_name(placement)
    split = _layer_split(placement, host)
    E = spec.num_experts
    out = []
    for li, (pinned, _) in enumerate(split):
        p = sum(pinned)
        free = max(0, min(host_slots, E) - p)  # LRU slots beyond the pinned experts
        if profile is not None:
            from moe_offload.control.placement import _che_hits

            np = _np()
            counts = profile.counts[li].astype(np.float64)[~np.array(pinned)]
            total = float(counts.sum())
            out.append(min(1.0, _che_hits(counts, free) / total) if total and free else (1.0 if not total else 0.0))
        else:
            out.append(free / (E - p) if E > p else 1.0)
    return out
