"""Per-layer expert slot caches on the accelerator: pinned experts + dynamic (LRU) slots.

    slot_of[e] -> slot index, or -1 when expert e is not resident (its home is the host store)

Pinned experts never move. Dynamic slots hold whatever the miss policy fetched,
evicting the least recently used. Recency is kept in an OrderedDict (O(1) per touch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from moe_offload.engines.offload.experts.store import LayerStore


class SlotCache:
    """Slots of one MoE layer on ``device``.

    ``pinned``: expert ids resident for the whole run. ``dynamic``: number of LRU slots.
    ``alias_pinned``: on a CPU accelerator the pinned slots are views of the host store
    (device memory *is* host memory there; a copy would only double resident memory).
    Dynamic slots are always real buffers, so fetch copies run for real on every backend.
    """

    def __init__(self, store: LayerStore, pinned: list[int], dynamic: int, device: torch.device, *, alias_pinned: bool):
        self.num_experts = store.num_experts
        self.pinned = tuple(pinned)
        self.dynamic = dynamic
        self.slot_of = [-1] * self.num_experts  # expert -> slot
        self.expert_in = []  # slot -> expert (-1 empty)
        self.weights: list[tuple[torch.Tensor | None, ...]] = []  # slot -> (up, down, up_bias, down_bias) views
        n = len(pinned) + dynamic
        self.buffer_bytes = (dynamic if alias_pinned else n) * store.expert_bytes  # what the slots allocated on ``device``
        if alias_pinned:
            for e in pinned:  # views only: a disk-backed store may still be reading them (the executor settles hits)
                self._add_slot(e, store.views(e))
            buffers = _alloc(store, dynamic, device)
            for s in range(dynamic):
                self._add_slot(-1, _slot_views(buffers, s))
        else:
            buffers = _alloc(store, n, device)
            for s, e in enumerate(pinned):
                for dst, src in zip(_slot_views(buffers, s), store.expert(e)):
                    if dst is not None:
                        dst.copy_(src)
            for s in range(n):
                self._add_slot(pinned[s] if s < len(pinned) else -1, _slot_views(buffers, s))
        # dynamic slot -> None, least recently used first; empty slots come first
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(len(pinned), n))

    def _add_slot(self, e: int, views):
        if e >= 0:
            self.slot_of[e] = len(self.expert_in)
        self.expert_in.append(e)
        self.weights.append(views)

    @property
    def num_slots(self) -> int:
        return len(self.expert_in)

    def touch(self, slot: int) -> None:
        """Mark a dynamic slot most recently used (pinned slots are ignored)."""
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def fetch(self, e: int, copy: Callable[[int, tuple, tuple], None], src: tuple) -> int:
        """Load expert ``e`` into the least recently used dynamic slot with ``copy(slot, dst_views, src_views)``; returns the slot."""
        slot, _ = self.lru.popitem(last=False)
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        copy(slot, self.weights[slot], src)
        self.expert_in[slot] = e
        self.slot_of[e] = slot
        self.lru[slot] = None
        return slot

    def resident(self) -> list[int]:
        return [e for e in self.expert_in if e >= 0]


def _alloc(store: LayerStore, n: int, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    return tuple(
        torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device) if t is not None else None for t in store.tensors
    )


def _slot_views(buffers, s: int):
    return tuple(b[s] if b is not None else None for b in buffers)
