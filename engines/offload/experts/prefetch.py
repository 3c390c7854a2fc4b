"""Prefetch ahead of the router: layer l+1's experts predicted from layer l's hidden state by layer l+1's own router.

    layer l's experts are called with x (its MoE input) --> router_{l+1}(x) --> top-k ids (per token, unique)
      --> reads started into layer l+1's host slots (CachedLayerStore.prefetch), overlapping layer l's compute
    layer l+1's experts are called --> its real ids vs the prediction: precision (guesses it chose) and recall
      (its choices guessed), counted in the disk tier's stats

The hidden state changes little from one layer's MoE input to the next (a residual stream), so the next router on
the current state picks most of the next layer's experts (80-89 % on released Qwen3 models, published). The
router's forward runs without its hooks (its time is not the model's routing time) and without grad.

A prefetch read pays only when the layer then uses it: a wrong one takes disk time from the reads the forward waits
for and evicts an expert. When the host cache already holds most of what layers ask for, the experts left to read
are the ones the router's guess gets wrong most often; so prefetching is gated on the measured share of recent
prefetch reads that were used (DiskStats.prefetch_useful >= USEFUL): below it, only one layer call in PROBE
prefetches, which keeps the measurement current.
"""

from __future__ import annotations

import torch

USEFUL = 0.5  # prefetch while at least this share of recent prefetch reads were used
PROBE = 8  # below it, every PROBE-th layer call still prefetches (to notice when guessing pays again)
# steps of more tokens (a prefill, a large batch) route to most of the next layer's experts: its demand reads follow
# within milliseconds and a guess would only queue in front of them
MAX_TOKENS = 4


class Prefetcher:
    def __init__(self, routers: list):
        self.routers = routers  # per executor layer position: the router module or None
        self.predicted: dict[int, set[int]] = {}
        self.calls = 0

    def after_route(self, executor, pos: int, x: torch.Tensor, ids: list[int], K: int) -> None:
        """Layer ``pos`` routed to ``ids`` (flat [T*K]) for input ``x`` [T, H]: score the prediction made for it, then
        predict and start reading layer ``pos + 1``'s experts."""
        disk = executor.disk
        guess = self.predicted.pop(pos, None)
        if guess is not None:
            chosen = set(ids)
            disk.counts["predicted"] += len(guess)
            disk.counts["predicted_used"] += len(guess & chosen)
            disk.counts["routed_experts"] += len(chosen)
        nxt = pos + 1
        if nxt >= len(executor.layers) or self.routers[nxt] is None or executor.dry or x.shape[0] > MAX_TOKENS:
            return
        store = executor.layers[nxt].store
        if not hasattr(store, "prefetch"):
            return
        # reads ahead only into the slots beyond the layer's own working set (K): with fewer, a wrong guess evicts an
        # expert the layer is about to use; one token's worth at most
        room = min(K, store.dynamic - K)
        if room <= 0:
            return
        self.calls += 1
        if disk.prefetch_useful < USEFUL:
            if self.calls % PROBE:
                return
            room = 1  # a probe: the most likely expert only, enough to keep the measurement current
        order = predict(self.routers[nxt], x, K)
        self.predicted[nxt] = set(order)
        store.prefetch(order[:room])


def predict(router, x: torch.Tensor, K: int) -> list[int]:
    """Expert ids ``router`` picks for ``x`` [T, H], most often picked first (a router returning (logits, scores,
    indices) gives its indices; one returning logits, their top-K)."""
    with torch.no_grad():
        out = router.forward(x)
    idx = None
    if isinstance(out, tuple):
        idx = next((t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2), None)
        logits = out[0]
    else:
        logits = out
    if idx is None:
        idx = torch.topk(logits.float().reshape(-1, logits.shape[-1]), K, dim=-1).indices
    ids, counts = torch.unique(idx.reshape(-1), return_counts=True)
    return ids[torch.argsort(counts, descending=True, stable=True)].tolist()
