"""Statistics: the executor's counters, attributed to the sequences of each forward, summed per request and engine.

    snapshot(executor) before a forward, again after --Accounting.book(scheduled, before, token_stats)-->
      each sequence's GenerationStats: hits and host pairs per token (token_stats [T, D + 1] when the forward held
      several sequences: hits on each of D accelerators, then host pairs), misses by routed pairs, copied bytes and
      stage times shared equally
    finished request --Accounting.finalise--> its hit rate per tier, then summed into ``total`` (the engine's)

T tokens of the forward; every token routes the same number of (token, expert) pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_offload.engines.base import GenerationStats


def snapshot(executor) -> tuple:
    """(hits, misses, host pairs, bytes copied, stage seconds, disk tier counters, hits per accelerator) so far:
    cheap enough to take every step. The disk counters ({} without a disk tier) carry stall_ms; hits per accelerator
    is {} with one."""
    st = getattr(executor, "stats", None)
    if st is None:
        return (0, 0, 0, 0, {}, {}, {}, {})
    t = st.totals()
    stage = dict(st.stage_s)
    stage["other"] = st.forward_s - sum(stage.values())
    disk = {}
    if getattr(st, "disk", None) is not None:
        disk = dict(st.disk.counts)
        disk["stall_ms"] = st.disk.stall_s * 1000
    per = st.hits_by_device() if hasattr(st, "hits_by_device") else {}
    copied = st.copied_by_device() if per else {}
    return (t["hits"], t["misses"], t["host_tokens"], t["bytes_copied"], stage, disk, per, copied)


def _all_ranks(hits, misses, host, copied, disk: dict, token_stats, n_tok: int, n_seq: int):
    """One forward's counters summed over the ranks of expert parallel (every rank books the same forwards), in one
    message from each rank to rank 0 (parallel.to_leader): hits, misses, host pairs, copied bytes, the disk tier's
    counters (each rank reads its own experts; a rank without a disk tier adds zeros) and, for several sequences,
    the per-token [T, 2] counts (one accelerator tier: --devices is not taken with ranks). Its stall time stays
    this rank's (the ranks wait together). The other ranks keep their own numbers: only rank 0 reports them (each
    rank's own executor numbers travel with engine.stats()["ranks"])."""
    from moe_offload.engines.offload.experts.hostcache import COUNTERS
    from moe_offload.engines.offload.ranks.parallel import to_leader

    if n_seq > 1 and token_stats is None:
        token_stats = torch.zeros(n_tok, 2, dtype=torch.int64)
    head = [hits, misses, host, copied, 1 if disk else 0] + [disk.get(k, 0) for k in COUNTERS]
    t = torch.tensor(head, dtype=torch.float64)  # counts, exact in float64 up to 2**53
    if n_seq > 1:
        t = torch.cat([t, token_stats.reshape(-1).to(torch.float64)])
    t = to_leader(t)
    if t is None:  # not rank 0
        return hits, misses, host, copied, disk, token_stats
    v = [int(x) for x in t[: len(head)].tolist()]
    if v[4]:
        disk = {**dict(zip(COUNTERS, v[5:])), "stall_ms": disk.get("stall_ms", 0.0)}
    if n_seq > 1:
        token_stats = t[len(head):].to(torch.int64).view(n_tok, 2)
    return (*v[:4], disk, token_stats)


class Accounting:
    """Per-request and engine-wide statistics. ``tier_names``: (accelerator tier, host tier) of the executor, or
    None without one (nothing to attribute then). Holds no reference to the executor: closing the engine frees it."""

    def __init__(self, tier_names: tuple[str, str] | None):
        self.tier_names = tuple(tier_names) if tier_names is not None else None
        self.total = GenerationStats()

    def book(self, executor, scheduled: Sequence, before: tuple, token_stats) -> None:
        """Attribute one forward's executor counters to its ``scheduled`` (sequence, tokens): hit and host pairs per
        token where the forward held several sequences; copied bytes and stage times shared equally (they serve
        the whole step). ``token_stats``: [T, 2] (slot hits, host pairs) per token of the forward, or None."""
        if executor is None:
            return
        after = snapshot(executor)
        hits, misses, host, copied = (after[i] - before[i] for i in range(4))
        stage = {k: v - before[4].get(k, 0.0) for k, v in after[4].items()}
        disk = {k: v - before[5].get(k, 0) for k, v in after[5].items()}
        per = {k: v - before[6].get(k, 0) for k, v in after[6].items()}  # several accelerators: hits on each
        per_copied = {k: v - before[7].get(k, 0) for k, v in after[7].items()}  # and bytes copied into each
        acc = executor.tier_names[0]
        n_seq, n_tok = len(scheduled), sum(n for _, n in scheduled)
        if getattr(executor, "ep", None) is not None:  # expert parallel: every rank's pairs (ranks/parallel.py)
            hits, misses, host, copied, disk, token_stats = _all_ranks(hits, misses, host, copied, disk, token_stats,
                                                                       n_tok, n_seq)
        q = 0
        for i, (seq, n) in enumerate(scheduled):
            st = seq.payload.stats
            if n_seq == 1:
                h, m, ho, mine = hits, misses, host, per
            else:  # [D + 1]: hits on each accelerator, host pairs
                rows = token_stats[q : q + n].sum(dim=0).tolist() if token_stats is not None else [0] * (len(per) + 2)
                h, ho = int(sum(rows[:-1])), int(rows[-1])
                mine = dict(zip(per, rows)) if per else {}
                m = (hits + misses) * n // n_tok - h  # every token routes the same number of pairs
            q += n
            st.hits += h
            st.misses += m
            st.host_expert_tokens += ho
            for k, v in mine.items():
                st.tier_hits[k] = st.tier_hits.get(k, 0) + int(v)
            for tier, b in (per_copied or {acc: copied}).items():  # copies serve the whole step: shared equally
                st.bytes_moved[tier] = st.bytes_moved.get(tier, 0) + b // n_seq + (b % n_seq if i == 0 else 0)
            for k, v in stage.items():
                st.stage_ms[k] = st.stage_ms.get(k, 0.0) + v * 1000 / n_seq
            for k, v in disk.items():  # reads serve the whole step: shared equally
                st.disk[k] = st.disk.get(k, 0.0) + v / n_seq
            if disk:
                st.bytes_moved["disk"] = st.bytes_moved.get("disk", 0) + disk["disk_bytes"] // n_seq

    def finalise(self, s: GenerationStats) -> None:
        """A finished request's per-tier rates, then its sum into the engine's totals (and theirs)."""
        self.tier_rates(s)
        if self.tier_names is not None:
            s.bytes_moved.setdefault(self.tier_names[0], 0)
        self.total.add(s)
        self.tier_rates(self.total)

    def tier_rates(self, s: GenerationStats) -> None:
        """Routed pairs served per tier: hits from the accelerator's slots, misses from the host tier."""
        if self.tier_names is not None:
            acc, host = self.tier_names
            routed = s.hits + s.misses
            s.hit_rate_by_tier = {acc: s.hits / routed if routed else 0.0, host: s.misses / routed if routed else 0.0}
            if s.tier_hits:  # several accelerators: each one's share
                s.hit_rate_by_tier = {**{k: v / routed if routed else 0.0 for k, v in s.tier_hits.items()},
                                      host: s.hit_rate_by_tier[host]}
