"""CUDA-only pieces of the executor: side-stream fetches with events, async device->host copies, free memory.

Not run on the development machine (no GPU); bench/gpu_check.py exercises them.

Fetch ordering on CUDA (all asynchronous to the host thread):
    compute stream:  ... kernels reading slot s ... [event used[s]]        [wait copied] kernels on slot s
    copy stream:                              [wait used[s]] H2D copy into s [event copied]
so a copy never overwrites a slot that queued kernels still read, and compute on a
fetched expert starts as soon as its copy lands, while other hits keep computing.
"""

from __future__ import annotations

import torch


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
