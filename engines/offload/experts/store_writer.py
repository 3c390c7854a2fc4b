"""Writing the expert store (diskstore.py: its layout and reading): one writer per directory, written under names of
its own and renamed into place, so a store is read whole or not at all.

    locked(dir) -- an flock on dir/store.lock: every --tensor-parallel rank opens the same store; one writes
    StoreWriter: experts.bin.<pid>.tmp, expert after expert --close()--> fsync, rename to experts.bin
                 --> store.json.<pid>.tmp, fsync, rename to store.json (the directory fsynced after each)
                 | abort(): its temporary files removed (a full disk, a failed read of the checkpoint)
    write_copy / write_in_place: a whole store from its records or its extents
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from pathlib import Path

import torch

from moe_offload.engines.offload.experts.diskstore import (
    DATA,
    LOCK,
    MANIFEST,
    VERSION,
    LayerEntry,
    Manifest,
    TensorEntry,
    layout,
    read_manifest,
)

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock across processes
    fcntl = None


@contextlib.contextmanager
def locked(directory: Path):
    """Hold the store directory's writer lock (an flock, which the kernel drops if its holder dies)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(d / LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clean(directory: Path) -> None:
    """Remove what writers killed mid-write left (their temporary files) and the data file of a store about to be
    written again (its manifest is gone or of another checkpoint: never read again; a reader that has it open keeps
    its bytes), so the new store needs the disk space of one. Call under ``locked``."""
    d = Path(directory)
    for f in [*d.glob(f"{DATA}.*.tmp"), *d.glob(f"{MANIFEST}.*.tmp"), d / DATA]:
        f.unlink(missing_ok=True)


def _replace(tmp: Path, final: Path) -> None:
    """``tmp`` (written and fsynced) renamed over ``final``, the rename made durable (the directory fsynced)."""
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StoreWriter:
    """Writes experts.bin sequentially (one expert in memory at a time) under a temporary name, then the manifest;
    close() renames both into place, abort() removes what it wrote. Call them under ``locked``."""

    def __init__(self, directory: Path, fmt: str, meta: dict | None = None, files: list[Path] | None = None):
        """``files``: a store in place over these files (add_extents, no experts.bin), else a copy (add_expert)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / MANIFEST).unlink(missing_ok=True)  # incomplete until close()
        self.fmt, self.meta = fmt, dict(meta or {})
        self.files = [Path(f).resolve() for f in files] if files is not None else None
        if self.files is not None:
            (self.dir / DATA).unlink(missing_ok=True)  # a copy written before: the checkpoint serves instead
        self._tmp = self.dir / f"{DATA}.{os.getpid()}.tmp"  # its own name: never a file another writer writes
        self._f = open(self._tmp, "wb") if self.files is None else None
        self._pos = 0
        self._crc = 0  # CRC-32 of every byte written, in order
        self.layers: list[LayerEntry] = []
        self._cur: list | None = None  # [name, layer, num_experts, offset, entries, record bytes, written, extents,
        #                                 record CRCs]

    def begin_layer(self, name: str, layer: int, num_experts: int) -> None:
        self._cur = [name, layer, num_experts, self._pos, None, None, 0, [], []]

    def add_expert(self, tensors: tuple[torch.Tensor | None, ...]) -> None:
        """The next expert's (up, down, up_scale, down_scale), as the host store holds them."""
        cur = self._cur
        entries, rb = layout(tensors)
        if cur[4] is None:
            cur[4], cur[5] = entries, rb
        elif entries != cur[4]:
            raise ValueError(f"{cur[0]}: expert {cur[6]} has a different layout than expert 0")
        record = bytearray(rb)
        for e, t in zip(entries, tensors):
            if e is not None:
                raw = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                record[e.offset: e.offset + e.nbytes] = raw
        self._f.write(record)
        self._crc = zlib.crc32(record, self._crc)
        cur[8].append(zlib.crc32(record))
        self._pos += rb
        cur[6] += 1

    def add_extents(self, entries: tuple[TensorEntry | None, ...], record_bytes: int,
                    extents: list[tuple[int, int, int, int]]) -> None:
        """In place: the next expert's record (layout ``entries``) is read from ``extents`` (file index into
        ``files``, file offset, bytes, record offset), which must fill its tensors exactly."""
        cur = self._cur
        if cur[4] is None:
            cur[4], cur[5] = entries, record_bytes
        elif entries != cur[4]:
            raise ValueError(f"{cur[0]}: expert {cur[6]} has a different layout than expert 0")
        if sum(x[2] for x in extents) != sum(t.nbytes for t in entries if t is not None):
            raise ValueError(f"{cur[0]}: expert {cur[6]}'s extents do not fill its record")
        cur[7].append(tuple(tuple(int(v) for v in x) for x in extents))
        cur[6] += 1

    def end_layer(self) -> None:
        name, layer, n, off, entries, rb, written, extents, crcs = self._cur
        if written != n:
            raise ValueError(f"{name}: {written} experts written, expected {n}")
        self.layers.append(LayerEntry(name, layer, n, off, rb, entries, tuple(extents) if self.files is not None else None,
                                      tuple(crcs) if self.files is None else None))
        self._cur = None

    def close(self) -> Path:
        doc = {"version": VERSION, "format": self.fmt, "data_bytes": self._pos, **self.meta}
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
            _replace(self._tmp, self.dir / DATA)
            doc["crc32"] = self._crc
        else:
            doc["files"] = [{"path": str(f), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
                            for f in self.files]
        doc["layers"] = [{"name": lay.name, "layer": lay.layer, "num_experts": lay.num_experts, "offset": lay.offset,
                          "record_bytes": lay.record_bytes,
                          "tensors": [None if t is None else {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                                               "offset": t.offset, "nbytes": t.nbytes}
                                      for t in lay.tensors],
                          **({"extents": [[list(x) for x in ex] for ex in lay.extents]} if lay.extents is not None else {}),
                          **({"record_crc32": list(lay.crcs)} if lay.crcs is not None else {})}
                         for lay in self.layers]
        tmp = self.dir / f"{MANIFEST}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(doc, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, self.dir / MANIFEST)
        return self.dir

    def abort(self) -> None:
        """Remove what this writer wrote (a failed write: a full disk, an error reading the checkpoint)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)
        (self.dir / f"{MANIFEST}.{os.getpid()}.tmp").unlink(missing_ok=True)


def write_copy(directory: Path, fmt: str, meta: dict, experts: list, layers) -> "Manifest":
    """A store copy: per experts module of ``experts`` its ``layers`` item, an iterable of (record tensors, whether
    its float weights were made [out, in] rows), one per expert. The first record prices the whole copy against the
    disk's free space before any byte is written (check_disk). Returns its manifest."""
    writer, rows_layers = None, []
    try:
        for info, records in zip(experts, layers):
            rows = False
            for e, (record, rows) in enumerate(records):
                if writer is None:
                    from moe_offload.hostmem import check_disk

                    check_disk(directory, layout(record)[1] * sum(i.num_experts for i in experts))
                    writer = StoreWriter(directory, fmt, meta)
                if e == 0:
                    writer.begin_layer(info.name, info.layer, info.num_experts)
                writer.add_expert(record)
            writer.end_layer()
            if rows:
                rows_layers.append(info.name)
        writer.meta["rows_layers"] = rows_layers  # experts modules whose float weights are stored as [out, in] rows
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return read_manifest(directory)


def write_in_place(directory: Path, fmt: str, meta: dict, files: list[Path], experts: list, layers: list) -> "Manifest":
    """A store in place over ``files``: per experts module of ``experts`` (name, layer, num_experts) its ``layers``
    item (record entries, record bytes, per expert extents). Returns its manifest."""
    writer = StoreWriter(directory, fmt, {**meta, "rows_layers": []}, files=files)
    try:
        for info, (entries, rb, extents) in zip(experts, layers):
            writer.begin_layer(info.name, info.layer, info.num_experts)
            for ex in extents:
                writer.add_extents(entries, rb, ex)
            writer.end_layer()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return read_manifest(directory)
