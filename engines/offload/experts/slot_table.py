"""The expert-to-slot table as a tensor on the accelerator: a step finds its hits there, without the host.

    table [L, E] int32 on the layers' device: table[l, e] = the slot of MoE layer l's cache holding expert e, -1 when
        the expert is not resident (its home is the tier below)
    TierSlots.slot_of (the host's bookkeeping, tiercache.py) --sync(): the rows whose version moved (a fetch, an
        eviction, a release)--> table rows, copied asynchronously
    slots_of(l, ids [T, K]) -> [T, K] int64 slots (-1: miss): one gather on the device, no host round trip

Why: a captured CUDA graph replays the same kernels each step; which experts a step hits must then be read on the
device from the step's router output, not decided in Python (issue 50). The executor's gathered hit path
(experts/cuda.py gathered_hits) reads its slots here: one index_select on the device, every (token, k) pair of the
step in fixed shapes. The host's lists stay the truth the policies decide with; the table follows them.
Legend: L MoE layers with an accelerator cache, E experts, T tokens, K experts per token.
"""

from __future__ import annotations

import torch


class SlotTable:
    """The slot table of ``caches`` (one TierSlots per MoE layer, in the executor's layer order) on ``device``."""

    def __init__(self, caches: list, device: torch.device):
        if not caches:
            raise ValueError("SlotTable: expected at least one layer's slot cache")
        experts = {len(c.slot_of) for c in caches}
        if len(experts) != 1:
            raise ValueError(f"SlotTable: expected one expert count for every layer, got {sorted(experts)}")
        self.caches, self.device = list(caches), torch.device(device)
        self.table = torch.full((len(caches), experts.pop()), -1, dtype=torch.int32, device=self.device)
        self.synced = [-1] * len(caches)  # each layer's cache version the table row holds
        self.sync()

    def sync(self, layer: int | None = None) -> int:
        """Copy the rows (``layer``'s, or every layer's) whose cache changed since the last sync; returns how many."""
        n = 0
        for i in range(len(self.caches)) if layer is None else (layer,):
            c = self.caches[i]
            if c.version != self.synced[i]:
                row = torch.tensor(c.slot_of, dtype=torch.int32)
                if self.device.type == "cuda":
                    row = row.pin_memory()
                self.table[i].copy_(row, non_blocking=True)
                self.synced[i] = c.version
                n += 1
        return n

    def slots_of(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Slots of the experts ``ids`` (any shape, on the table's device) in ``layer``'s cache, -1 for a miss."""
        row = self.table[layer]
        return row.index_select(0, ids.reshape(-1).to(torch.long)).to(torch.long).reshape(ids.shape)
