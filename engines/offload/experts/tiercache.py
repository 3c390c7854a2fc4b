"""One tier's slots over the tier below it: the bookkeeping every cache tier of the hierarchy shares.

    slot_of[e]      -> the slot holding expert e, or -1 (not in this tier: the tier below has it)
    expert_in[slot] -> the expert in that slot, or -1 (empty)
    pinned experts sit in the first P slots and are never evicted; the other slots are an LRU (least recent first)

Each tier is this bookkeeping plus a way to fill a slot from the tier below: the accelerator's slot caches copy
from host memory (slots.SlotCache), host memory over the disk reads a record of the expert store
(hostcache.CachedLayerStore). Another tier (a second accelerator, a remote store) is another filler over the same
bookkeeping. Legend: E experts, P pinned, D dynamic (LRU) slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class TierSlots:
    """Slot bookkeeping of one MoE layer in one tier; subclasses call ``_init_slots`` and fill slots themselves."""

    def _init_slots(self, num_experts: int, pinned: Sequence[int], slots: int) -> None:
        self.pinned = tuple(pinned)
        self.slot_of = [-1] * num_experts
        self.expert_in = [-1] * slots
        for s, e in enumerate(self.pinned):
            self.slot_of[e], self.expert_in[s] = s, e
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(len(self.pinned), slots))
        self.version = 0  # moves with every change of slot_of (slot_table.SlotTable copies a row when it moved)

    @property
    def num_slots(self) -> int:
        return len(self.expert_in)

    @property
    def dynamic(self) -> int:
        """Slots that are not pinned (D)."""
        return len(self.lru)

    def touch(self, slot: int) -> None:
        """Mark a dynamic slot most recently used (pinned slots are ignored)."""
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def victim(self) -> int:
        """The slot ``claim`` takes next (the least recently used dynamic one)."""
        return next(iter(self.lru))

    def claim(self, e: int) -> tuple[int, int]:
        """The least recently used dynamic slot, now expert ``e``'s and most recently used: (slot, the expert it
        held, or -1). The caller fills it."""
        s, _ = self.lru.popitem(last=False)
        old = self.expert_in[s]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[s], self.slot_of[e] = e, s
        self.lru[s] = None
        self.version += 1
        return s, old

    def release(self, slot: int) -> None:
        """Empty ``slot`` (its bytes are not an expert's any more); it is the first dynamic slot reused."""
        e = self.expert_in[slot]
        if e >= 0:
            self.slot_of[e] = -1
        self.expert_in[slot] = -1
        self.version += 1
        if slot in self.lru:
            self.lru.move_to_end(slot, last=False)

    def resident(self) -> list[int]:
        return [e for e in self.expert_in if e >= 0]
