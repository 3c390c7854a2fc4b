"""Per-layer expert slot caches on the accelerators: pinned experts + dynamic (LRU) slots over host memory.

    slot_of[e] -> slot index, or -1 when expert e is not resident (its home is the host store)
    device_of[slot] -> which of the layer's accelerators (``devices``) holds the slot

Several accelerators (``--devices``) are parts of one layer's cache: each holds its pinned experts and its dynamic
slots; slots are numbered pinned first (device 0's, then device 1's...), then dynamic in the same device order, and
one LRU spans every device's dynamic slots.

The bookkeeping is the tier's (tiercache.TierSlots); what this tier adds is its buffers and how a slot is filled:
a copy of the expert's stored bytes from host memory. Pinned experts never move. Dynamic slots hold whatever the miss
policy fetched, evicting the least recently used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.experts.tiercache import TierSlots


class SlotCache(TierSlots):
    """Slots of one MoE layer on ``device`` (and on each further device of ``more``).

    ``pinned``: expert ids resident for the whole run. ``dynamic``: number of LRU slots.
    ``alias_pinned``: on a CPU accelerator the pinned slots are views of the host store
    (device memory *is* host memory there; a copy would only double resident memory).
    Dynamic slots are always real buffers, so fetch copies run for real on every backend.
    ``more``: (device, pinned, dynamic) of the layer's other accelerators.
    """

    def __init__(self, store: LayerStore, pinned: list[int], dynamic: int, device: torch.device, *, alias_pinned: bool,
                 more: Sequence[tuple[torch.device, list[int], int]] = ()):
        parts = [(device, list(pinned), dynamic), *((d, list(p), n) for d, p, n in more)]
        every = [e for _, p, _ in parts for e in p]
        if len(set(every)) != len(every):
            raise ValueError("an expert pinned on two devices")
        self.num_experts = store.num_experts
        self.devices = [d for d, _, _ in parts]
        self._init_slots(store.num_experts, every, len(every) + sum(n for _, _, n in parts))
        self.device_of = [i for i, (_, p, _) in enumerate(parts) for _ in p] + [i for i, (_, _, n) in enumerate(parts)
                                                                                for _ in range(n)]
        pinned_w, dynamic_w = [], []
        # one device whose slots are real buffers: those buffers, [slots, ...] each, slot s at index s (a decode step
        # gathers its experts' weights from them in one call: dispatch.experts_gathered); else None
        self.stacked: tuple[torch.Tensor | None, ...] | None = None
        self.buffer_bytes = 0  # what the slots allocated on the devices
        for d, p, n in parts:
            alias = alias_pinned and d.type == "cpu"
            self.buffer_bytes += (n if alias else len(p) + n) * store.expert_bytes
            if alias:  # views only: a disk-backed store may still be reading them (the executor settles hits)
                pinned_w += [store.views(e) for e in p]
                buffers = _alloc(store, n, d)
                dynamic_w += [_slot_views(buffers, s) for s in range(n)]
            else:
                buffers = _alloc(store, len(p) + n, d)
                if len(parts) == 1:
                    self.stacked = buffers
                for s, e in enumerate(p):
                    for dst, src in zip(_slot_views(buffers, s), store.expert(e)):
                        if dst is not None:
                            dst.copy_(src)
                pinned_w += [_slot_views(buffers, s) for s in range(len(p))]
                dynamic_w += [_slot_views(buffers, s) for s in range(len(p), len(p) + n)]
        self.weights: list[tuple[torch.Tensor | None, ...]] = pinned_w + dynamic_w  # slot -> (up, down, ...) views
        self.fills = [0] * len(parts)  # experts copied into each device's slots so far

    def fetch(self, e: int, copy: Callable[[int, tuple, tuple], None], src: tuple) -> int:
        """Load expert ``e`` into the least recently used dynamic slot with ``copy(slot, dst_views, src_views)``; returns the slot."""
        slot, _ = self.claim(e)
        copy(slot, self.weights[slot], src)
        self.fills[self.device_of[slot]] += 1
        return slot

    def pinned_weights(self, ep: tuple[int, int] | None = None) -> list[tuple] | None:
        """Every expert's slot views by expert id when every expert is pinned (the whole-step call holds them), else
        None. ``ep`` (rank, world) of expert parallel: every expert of this rank (e % world == rank) pinned; the
        others' entries are one of this rank's views, never read (the call skips their pairs)."""
        rank, world = ep or (0, 1)
        mine = [e for e in range(self.num_experts) if e % world == rank]
        if not mine or not set(mine) <= set(self.pinned):
            return None
        stand_in = self.weights[self.slot_of[mine[0]]]
        return [self.weights[self.slot_of[e]] if e % world == rank else stand_in for e in range(self.num_experts)]

    def device_pairs(self, hits) -> list[int]:
        """Routed pairs of ``hits`` [((expert, start, n), slot)] per device, in ``devices`` order."""
        out = [0] * len(self.devices)
        for g, s in hits:
            out[self.device_of[s]] += g[2]
        return out


def _alloc(store: LayerStore, n: int, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    return tuple(
        torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device) if t is not None else None for t in store.tensors
    )


def _slot_views(buffers, s: int):
    return tuple(b[s] if b is not None else None for b in buffers)
