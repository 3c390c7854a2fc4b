"""Routed experts read straight from the checkpoint's safetensors into the host store: one pread per tensor.

    *.safetensors headers --Offsets--> key -> (file, byte offset, dtype, shape)
    per layer: up [E, R, K] and down [E, H, I] allocated once in the compute dtype, then per expert and projection
      (gate | up parts, as transformers' conversion concatenates them) one pread into its rows, or, when the file's
      dtype differs, a read of that tensor and a cast into them

Why not from_pretrained: it reads every per-expert tensor through mmap, stacks and concatenates them into the fused
[E, ...] parameters (a second copy) and keeps the file's pages mapped while it does: a bf16 checkpoint peaked at
2.0x its size in resident memory. Here the store's tensors are the only copy and the page cache is told to drop
what was read (posix_fadvise), so a model that fits loads with ~1.0x. Layouts this does not cover (experts that are
transposed, omni wrappers) keep the from_pretrained path.

The disk tier's store of a checkpoint (write_store, for convert.py and gguf_store.py) is such extents where the files
hold each expert as the engine computes from it (a manifest, no copy), else a copy written once.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import torch

from moe_offload.engines.offload.experts import diskstore, store_writer
from moe_offload.engines.offload.experts.diskstore import pread_into
from moe_offload.engines.offload.loading import hugepages
from moe_offload.errors import ModelError
from moe_offload.log import get_logger

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64}


class Offsets:
    """Where each tensor of a checkpoint's safetensors files lies; ``read_into(key, dst)`` fills ``dst`` with it."""

    def __init__(self, root: Path):
        self.where: dict[str, tuple[str, int, torch.dtype, tuple[int, ...]]] = {}
        self.fds: dict[str, int] = {}
        for f in sorted(Path(root).glob("*.safetensors")):
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            base = 8 + n
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                dt = DTYPES.get(meta["dtype"])
                if dt is None:
                    continue
                self.where[key] = (str(f), base + meta["data_offsets"][0], dt, tuple(meta["shape"]))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def fd(self, path: str) -> int:
        """A read descriptor of ``path``, opened once (closed by ``close``)."""
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self.fds[path]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.where[key][3]

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """``dst`` (contiguous, the tensor's number of elements) := the checkpoint's tensor ``key``, cast if needed.
        Thread-safe (pread); the bytes read are dropped from the page cache by ``drop``."""
        path, off, dt, shape = self.where[key]
        numel = 1
        for s in shape:
            numel *= s
        if dst.numel() != numel:
            raise ModelError(f"{key}: {numel} values in the checkpoint, expected {dst.numel()}")
        tmp = dst if dt == dst.dtype else torch.empty(dst.shape, dtype=dt)
        view = memoryview(tmp.view(torch.uint8).reshape(-1).numpy())
        got = pread_into(self.fd(path), view, off)
        if got != len(view):
            raise ModelError(f"{path}: {key} is truncated (read {got} of {len(view)} bytes)")
        if tmp is not dst:
            dst.copy_(tmp)

    def drop(self) -> None:
        """Tell the page cache to drop the files read so far: the store holds those bytes now, not twice."""
        if hasattr(os, "posix_fadvise"):
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_float_layer(offsets: Offsets, src, module, num_experts: int, dtype: torch.dtype, pool=None, only=None):
    """(up [E, R, K], down [E, H, I]) of one layer of a float checkpoint in ``dtype``, or None when this layout is not
    one this reader covers (the caller loads through from_pretrained). ``pool``: a thread pool the reads run on
    (several in flight keep the disk's queue full), else one after another. ``only``: (rank, world) of expert
    parallel: where the checkpoint stores each expert apart, only experts e with e mod world == rank are read (the
    others' rows are never touched, so their memory is never committed)."""
    if module.is_transposed:
        return None
    out, jobs = [], []
    for proj in (src.up, src.down):
        if proj.fused is not None:
            shape = offsets.shape(proj.fused)
            t = hugepages.empty(shape, dtype)
            jobs.append((proj.fused, t))
            out.append(t)
            continue
        parts = [proj.parts[0][i] for i in range(proj.nparts)]
        rows = [offsets.shape(k)[0] for k in parts]
        cols = offsets.shape(parts[0])[1]
        t = hugepages.empty((num_experts, sum(rows), cols), dtype)
        for e in range(num_experts):
            if only is not None and e % only[1] != only[0]:
                continue
            r0 = 0
            for i in range(proj.nparts):
                jobs.append((proj.parts[e][i], t[e, r0: r0 + rows[i]]))
                r0 += rows[i]
        out.append(t)
    if pool is None:
        for key, dst in jobs:
            offsets.read_into(key, dst)
    else:
        for f in [pool.submit(offsets.read_into, key, dst) for key, dst in jobs]:
            f.result()
    offsets.drop()
    return tuple(out)


def same_bytes(fds: list[int], extents, entries: tuple, record_bytes: int,
               want: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether one expert's ``extents`` (file index into ``fds``, offset, bytes, record offset) read into a record
    of layout ``entries`` give the record tensors ``want`` byte for byte (a store in place is checked so)."""
    buf = torch.zeros(record_bytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    for f, off, n, at in extents:
        if pread_into(fds[f], view[at: at + n], off) != n:
            return False
    return all(t is None or torch.equal(buf[e.offset: e.offset + e.nbytes], t.contiguous().view(torch.uint8).reshape(-1))
               for t, e in zip(want, entries))


def write_store(directory: Path, fmt: str, origin: str, experts: list, in_place, records) -> diskstore.Manifest:
    """Write the expert store of the checkpoint at ``origin`` (its path, kept as the manifest's "checkpoint"): in place
    (a manifest of extents of its files) when ``in_place()`` gives (files, per layer items of write_in_place), else a
    copy of ``records(info)`` per experts module (store_writer.write_copy), ``in_place()`` having said why (a str)."""
    with store_writer.locked(directory):  # one writer per store; the others (ranks of one worker) wait for its result
        man = diskstore.read_manifest(directory)
        if man is not None and man.meta.get("checkpoint") == origin:
            return man  # written by another process while this one waited
        store_writer.clean(directory)  # a killed writer's files; none is writing now (the lock)
        return _write_store(directory, fmt, origin, experts, in_place, records)


def _write_store(directory: Path, fmt: str, origin: str, experts: list, in_place, records) -> diskstore.Manifest:
    log, t0 = get_logger("moe_offload.store"), time.perf_counter()
    log.info("writing the expert store (once per checkpoint and format)", checkpoint=origin, store=str(directory),
             format=fmt)
    place = in_place()
    if not isinstance(place, str):
        man = store_writer.write_in_place(directory, fmt, {"checkpoint": origin}, place[0], experts, place[1])
        log.info("expert store in place: the checkpoint's files are read where they are", store=str(directory),
                 seconds=round(time.perf_counter() - t0, 1), manifest_bytes=man.disk_bytes)
        return man
    log.info("expert store copied: the checkpoint's layout is not the one the engine computes from", why=place,
             store=str(directory))
    man = store_writer.write_copy(directory, fmt, {"checkpoint": origin}, experts, (records(info) for info in experts))
    log.info("expert store written", store=str(directory), seconds=round(time.perf_counter() - t0, 1),
             gib=round(man.data_bytes / 2**30, 3))
    return man
