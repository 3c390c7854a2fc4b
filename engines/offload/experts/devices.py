"""Several accelerators (--devices) and ranks (expert parallel): routed pairs per device, rows summed over ranks.

    a layer's hits [((expert, start, n), slot)] --SlotCache.device_pairs--> pairs per device (stats, per layer)
    a layer's routes [T, K] --count_tokens--> token_stats [T, D + 1]: slot hits on each device, then host pairs

With one device token_stats is [T, 2] (hits, host pairs), as the engine's accounting has always read it.
"""

from __future__ import annotations

import torch


def pairs_by_device(cache, routes: torch.Tensor) -> list[int]:
    """Routed pairs of ``routes`` (expert ids, any shape, every one in a slot) per device of ``cache``."""
    out = [0] * len(cache.devices)
    for e in routes.reshape(-1).tolist():
        out[cache.device_of[cache.slot_of[e]]] += 1
    return out


def count_tokens(ex, cache, top_k_index: torch.Tensor, hits, host_experts: list[int]) -> None:
    """Add one layer's pairs per token to ``ex.token_stats`` [T, D + 1] (D accelerators: each one's slot hits, then
    the pairs computed on the host; fetched pairs count in neither). ``hits``: [((expert, start, n), slot)] of this
    layer, or None for a layer whose every expert is resident (the whole-step path)."""
    T = top_k_index.shape[0]
    D = len(ex.device_tiers)
    if ex.token_stats is None or ex.token_stats.shape != (T, D + 1):
        ex.token_stats = torch.zeros(T, D + 1, dtype=torch.int64)
    if hits is not None:
        code = torch.full((cache.num_experts,), -1, dtype=torch.int8)  # per expert: device of its hit, D host, -1
        for g, s in hits:
            code[g[0]] = cache.device_of[s]
        if host_experts:
            code[host_experts] = D
    else:
        code = torch.tensor([cache.device_of[s] if s >= 0 else -1 for s in cache.slot_of], dtype=torch.int8)
    c = code[top_k_index.cpu()]  # [T, K]
    for col in range(D + 1):
        ex.token_stats[:, col] += (c == col).sum(dim=1)


def all_ranks(proj: torch.Tensor) -> torch.Tensor:
    """``proj`` [S, H] summed over the ranks of expert parallel (each row is non-zero on one rank only, so the sum is
    that rank's row, bit for bit)."""
    from moe_offload.engines.offload.ranks.parallel import over_ranks

    return over_ranks(proj)
