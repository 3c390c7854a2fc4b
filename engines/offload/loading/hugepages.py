"""Host weights in transparent huge pages (2 MiB), for the CPU kernels that stream them.

A decode step reads every weight it uses once, front to back: on 4 KiB pages that is a TLB miss and a page walk per
4 KiB. With the weights in 2 MiB pages a decode step took 2-7 % less time in paired runs (docs/benchmarks/kernels.md,
"Weights in huge pages"); llama.cpp's mmapped GGUF gets the same from the page cache's large folios.

Linux hands out huge pages to anonymous memory only where THP is "always", or "madvise" and the range was advised
(MADV_HUGEPAGE), and only at the first touch of a page (later, khugepaged collapses a few MiB every 10 s). So the
memory is a fresh mapping of its own (malloc may return pages it touched before), advised before any write:

    empty(shape, dtype)   a tensor whose 2 MiB-aligned pages are advised before anything touches them (the loaders
                          read experts straight into it: no copy)
    rehome(t)             a tensor allocated elsewhere (transformers' modules, quantized at load) copied into one
                          of those; t itself when it is small, not a plain host tensor, or already in one
    rehome_module(m)      every parameter and buffer of m rehomed in place (tied weights stay tied)

The disk tier (host slots over an expert store file, under a memory limit) keeps 4 KiB pages: there huge pages
raised the peak RSS by ~0.2 GiB under a 1.8 GiB cgroup limit (docs/benchmarks/disk.md).

Elsewhere (not Linux, THP "never", MOE_OFFLOAD_HUGEPAGES=0) every call is a plain allocation / the tensor itself.
The cost is start-up time where the kernel must compact memory to find free 2 MiB pages (0.2-1.4 s per GiB measured
on a host whose page cache held the checkpoints).
"""

from __future__ import annotations

import functools
import mmap
import sys
import weakref

import torch

from moe_offload import settings

PAGE = 1 << 21
MIN_BYTES = 4 << 20  # smaller tensors hold at most one huge page: not worth a copy
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_advised: dict[int, weakref.ref] = {}  # storage address -> the mapping empty() made there (gone when unmapped)


@functools.cache
def _thp_mode() -> str:
    try:
        with open(_THP) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def available() -> bool:
    """Huge pages can back host weights here: Linux, THP "always" or "madvise", MOE_OFFLOAD_HUGEPAGES not off."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and settings.get("MOE_OFFLOAD_HUGEPAGES")
            and _thp_mode() in ("always", "madvise"))


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the host, its memory advised for huge pages before its first touch (a
    plain torch.empty where huge pages are not available or the tensor is small)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < MIN_BYTES or not available():
        return torch.empty(shape, dtype=dtype)
    # a mapping of its own, not malloc's: malloc may hand back memory it touched before, whose 4 KiB pages stay
    mm = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: THP's, not shmem's
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping: unmapped when the last view goes
    start = (-raw.data_ptr()) % PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes // PAGE * PAGE)
    except (OSError, ValueError):  # a refused range: 4 KiB pages, as before
        return torch.empty(shape, dtype=dtype)
    for key in [k for k, ref in _advised.items() if ref() is None]:  # mappings since unmapped
        del _advised[key]
    _advised[raw.untyped_storage().data_ptr()] = weakref.ref(mm)
    return raw[start: start + nbytes].view(dtype).view(shape)


def advised(t: torch.Tensor) -> bool:
    """t lives in memory empty() advised (a mapping still alive: an address malloc reuses later is not)."""
    ref = _advised.get(t.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


def rehome(t: torch.Tensor) -> torch.Tensor:
    """t, copied into huge-page memory (empty) when it is a contiguous host tensor of MIN_BYTES or more outside it;
    else t itself."""
    if (t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < MIN_BYTES or t.is_pinned()
            or advised(t) or not available()):
        return t
    new = empty(t.shape, t.dtype)
    if not advised(new):
        return t
    return new.copy_(t)


def rehome_module(module: torch.nn.Module) -> int:
    """Every parameter and buffer of ``module`` rehomed in place (``.data`` swapped, so every holder of the
    parameter sees the new memory; tensors sharing one storage, as tied embeddings, share the new one). Returns
    the bytes moved."""
    return _swap_data(module, rehome)


def _swap_data(module: torch.nn.Module, make) -> int:
    """``make(t)`` (a new tensor, or t itself) for every parameter and buffer of ``module``, swapped in as ``.data``;
    tensors sharing one storage get the one new tensor. Returns the bytes of the new tensors."""
    moved: dict[int, torch.Tensor] = {}
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.data_ptr()
        if key in moved:
            if moved[key].shape == t.shape and moved[key].dtype == t.dtype:
                t.data = moved[key]
            continue
        old = t.data  # a new tensor object per access: compare with this one
        new = make(old)
        if new is not old:
            total += new.numel() * new.element_size()
            t.data = new
        moved[key] = new
    return total


def file_ranges(paths) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the files ``paths`` (/proc/self/maps; [] where unknown)."""
    names = {str(p) for p in paths}
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in names:
                    a, b = parts[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def copy_out_of_files(module: torch.nn.Module, paths) -> int:
    """Every parameter and buffer of ``module`` that still lies in a memory map of the files ``paths`` (safetensors
    loads tensors as views of the file) copied into anonymous memory, in place (shared storages stay shared). A file
    truncated or replaced under a running process would otherwise kill it with SIGBUS at the next touch of a page
    that left the page cache. Returns the bytes copied."""
    ranges = file_ranges(paths)
    if not ranges:
        return 0
    def out_of_files(t: torch.Tensor) -> torch.Tensor:
        mapped = t.device.type == "cpu" and any(a <= t.data_ptr() < b for a, b in ranges)
        return t.clone() if mapped else t

    return _swap_data(module, out_of_files)


def huge_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages now (/proc/self/smaps_rollup), 0 where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
