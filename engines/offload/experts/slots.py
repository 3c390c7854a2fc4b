"""Per-layer expert slot caches on the accelerator: pinned experts + dynamic (LRU) slots over host memory.

    slot_of[e] -> slot index, or -1 when expert e is not resident (its home is the host store)

The bookkeeping is the tier's (tiercache.TierSlots); what this tier adds is its buffers and how a slot is filled:
a copy of the expert's stored bytes from host memory. Pinned experts never move. Dynamic slots hold whatever the miss
policy fetched, evicting the least recently used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.experts.tiercache import TierSlots


class SlotCache(TierSlots):
    """Slots of one MoE layer on ``device``.

    ``pinned``: expert ids resident for the whole run. ``dynamic``: number of LRU slots.
    ``alias_pinned``: on a CPU accelerator the pinned slots are views of the host store
    (device memory *is* host memory there; a copy would only double resident memory).
    Dynamic slots are always real buffers, so fetch copies run for real on every backend.
    """

    def __init__(self, store: LayerStore, pinned: list[int], dynamic: int, device: torch.device, *, alias_pinned: bool):
        self.num_experts = store.num_experts
        n = len(pinned) + dynamic
        self._init_slots(store.num_experts, pinned, n)
        self.weights: list[tuple[torch.Tensor | None, ...]] = []  # slot -> (up, down, up_bias, down_bias, ...) views
        self.buffer_bytes = (dynamic if alias_pinned else n) * store.expert_bytes  # what the slots allocated on ``device``
        if alias_pinned:
            # views only: a disk-backed store may still be reading them (the executor settles hits)
            self.weights = [store.views(e) for e in pinned]
            buffers = _alloc(store, dynamic, device)
            self.weights += [_slot_views(buffers, s) for s in range(dynamic)]
        else:
            buffers = _alloc(store, n, device)
            self.weights = [_slot_views(buffers, s) for s in range(n)]
            for s, e in enumerate(pinned):
                for dst, src in zip(self.weights[s], store.expert(e)):
                    if dst is not None:
                        dst.copy_(src)

    def fetch(self, e: int, copy: Callable[[int, tuple, tuple], None], src: tuple) -> int:
        """Load expert ``e`` into the least recently used dynamic slot with ``copy(slot, dst_views, src_views)``; returns the slot."""
        slot, _ = self.claim(e)
        copy(slot, self.weights[slot], src)
        return slot


def _alloc(store: LayerStore, n: int, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    return tuple(
        torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device) if t is not None else None for t in store.tensors
    )


def _slot_views(buffers, s: int):
    return tuple(b[s] if b is not None else None for b in buffers)
