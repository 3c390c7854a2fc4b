"""Approximate modes of the executor (opt-in, labelled approximate wherever output is served): tail skip.

    tail_skip r: a token's routed pairs ranked r or lower (0-based, by router weight) whose expert is in no slot are
    dropped (the NPU design's TAIL_SKIP); the top pair is never dropped. cold_dtype (the loader): misses computed
    from a lower-precision copy of the experts (LayerState.cold).
"""

from __future__ import annotations

import torch


def skip_tail(ex, cache, top_k_index, top_k_weights, ids):
    """Drop each token's pairs ranked ``tail_skip`` or lower whose expert is not in a slot: (index, weights, ids)
    without them. One token: its K shrinks; several: a dropped pair becomes the token's top pair again with weight
    0 (one more row in a group that runs anyway: its product adds nothing). Counted in ``skipped``."""
    T, K = top_k_index.shape
    slot_of, r = cache.slot_of, ex.tail_skip
    if T == 1:  # a decode step's layer: in Python, K values
        ws = top_k_weights[0].tolist()
        order = sorted(range(K), key=lambda k: -ws[k])  # stable: ties keep the router's order
        drop = {k for k in order[r:] if slot_of[ids[k]] < 0}
        if not drop:
            return top_k_index, top_k_weights, ids
        ex.skipped += len(drop)
        keep = [k for k in range(K) if k not in drop]
        return top_k_index[:, keep], top_k_weights[:, keep], [ids[k] for k in keep]
    order = top_k_weights.argsort(dim=1, descending=True, stable=True)  # [T, K]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(K, device=order.device).expand(T, K))
    cold = (torch.tensor(slot_of)[top_k_index.cpu()] < 0).to(order.device)  # [T, K]
    drop = (rank >= r) & cold
    n = int(drop.sum())
    if not n:
        return top_k_index, top_k_weights, ids
    ex.skipped += n
    top = top_k_index.gather(1, order[:, :1]).expand(T, K)
    top_k_index = torch.where(drop, top, top_k_index)
    return top_k_index, top_k_weights.masked_fill(drop, 0), top_k_index.reshape(-1).tolist()

