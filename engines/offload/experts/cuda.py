"""CUDA-only pieces of the executor: side-stream fetches with events, async device->host copies, free memory.

CI has no GPU: bench/gpu_run.sh exercises them on a lent one (docs/benchmarks/gpu.md); gathered_hits also runs on the
CPU in tests/engines/offload/experts/test_gathered.py.

Fetch ordering on CUDA (all asynchronous to the host thread):
    compute stream:  ... kernels reading slot s ... [event used[s]]        [wait copied] kernels on slot s
    copy stream:                              [wait used[s]] H2D copy into s [event copied]
so a copy never overwrites a slot that queued kernels still read, and compute on a
fetched expert starts as soon as its copy lands, while other hits keep computing.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload.kernels.dispatch import experts_gathered
from moe_offload.engines.offload.loading import quant


class CudaCopier:
    """Copies experts from the pinned host store into device slots on a side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def record(self) -> torch.cuda.Event:
        """An event on the compute stream after the kernels queued so far (a slot's last use)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, dst: tuple, src: tuple, used: "torch.cuda.Event | None") -> None:
        """Copy ``src`` (pinned host views) into ``dst`` (slot views) after ``used`` (the slot's last use);
        the compute stream waits for the copy before it reads the slot."""
        with torch.cuda.stream(self.stream):
            if used is not None:
                self.stream.wait_event(used)
            for d, s in zip(dst, src):
                if d is not None:
                    d.copy_(s, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)


def to_host_async(x: torch.Tensor):
    """Start a non-blocking device->host copy of ``x`` into pinned memory; returns a function that waits for it."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(x.device))

    def wait() -> torch.Tensor:
        ev.synchronize()
        return host

    return wait


def free_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes, as the driver reports it."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def check_device(device: torch.device) -> None:
    from moe_offload.errors import BackendUnavailable

    if not torch.cuda.is_available():
        raise BackendUnavailable(f"device {device}: torch.cuda.is_available() is False (torch {torch.__version__})")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise BackendUnavailable(f"device {device}: expected an index < {torch.cuda.device_count()} GPUs, got {index}")


# A step's hit pairs go through the gathered path while their weights' copy stays under this (a prefill chunk's
# thousands of pairs keep the per-expert GEMMs, which read each expert once for all its tokens).
GATHER_MAX_BYTES = 256 << 20


def slot_rows(table, state, module, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every routed pair (ids [T, K]) of rows x [T, H] through the expert in its slot, without the host: the slot from
    the device's slot table, the weights gathered from the layer's stacked slot buffers (dispatch.experts_gathered;
    a miss reads slot 0). Returns (y [T * K, H] unweighted, hit [T * K] bool)."""
    K = ids.shape[1]
    slots = table.slots_of(state.pos, ids).reshape(-1)  # [T * K] on the device, -1: a miss
    up, down, up_bias, down_bias = (t.index_select(0, slots.clamp(min=0)) if t is not None else None
                                    for t in state.cache.stacked[:4])
    return experts_gathered(module, x.repeat_interleave(K, dim=0), up, down, up_bias, down_bias), slots >= 0


def gathered_hits(executor, state, module, x: torch.Tensor, top_k_index: torch.Tensor, ids: list[int],
                  proj) -> bool:
    """Compute a layer's slot hits in one gathered call (dispatch.experts_gathered) when its slots are one device's
    float buffers: every (token, k) pair of the step in fixed shapes, its slot read from the device's slot table
    (slot_table.py; a miss's clamped to slot 0), its weights gathered by slot and its token's row by pair; the hit
    pairs' rows are placed in ``proj`` as the per-expert loop places them (misses' rows are left to the miss paths).
    ``ids``: top_k_index as the host's list (the CUDA slots' last-use events). Returns True; False when the layer does
    not qualify (several devices, quantized or aliased slots, too many pairs), leaving the loop to run."""
    cache = state.cache
    stacked = cache.stacked
    if stacked is None or stacked[0].dtype in quant.FORMAT_OF_DTYPE or stacked[0].device != x.device:
        return False
    if len(ids) * state.expert_bytes > GATHER_MAX_BYTES:
        return False
    table = executor.slot_table()
    table.sync(state.pos)  # what this step's fetches and evictions so far changed
    y, hit = slot_rows(table, state, module, x, top_k_index.to(x.device))
    proj.copy_(torch.where(hit.unsqueeze(1), y.to(proj.dtype), proj))
    if executor._cuda:  # the slots' last use, before a fetch may overwrite one
        ev = executor._copiers[x.device].record()
        slot_of = cache.slot_of
        for e in ids:
            if slot_of[e] >= 0:
                state.events[slot_of[e]] = ev
    return True
