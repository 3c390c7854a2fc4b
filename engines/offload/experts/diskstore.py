"""The expert store file: every routed expert once, on disk, as the engine stores it; one aligned record per expert.

    <dir>/store.json   manifest: version, format, per layer {name, layer, num_experts, offset, record_bytes,
                       tensors [{name, dtype, shape, offset, nbytes}]} (offsets in bytes)
    <dir>/experts.bin  layer after layer, expert after expert: record = up | down | up_scale | down_scale,
                       each tensor at a 64-byte offset, the record padded to ALIGN (4 KiB)

A miss is one read of one record (``pread`` of record_bytes at an ALIGN offset), straight into a host cache slot of
the same layout, so the tensors are views of the bytes just read: no copy, no parse. ALIGN-aligned offsets, sizes and
buffers also allow O_DIRECT, which keeps the page cache from holding a second copy of what the host cache holds.
Biases are not in the records: they are small and stay in memory with the model.

Writing (store_writer.py): the data file and then the manifest are written under temporary names of the writer's own
and renamed into place
(each fsynced first): a reader finds the old store whole, or the new one whole, never a file being written (a
worker that opened the old data file keeps reading its bytes); a write that fails (a full disk) leaves no partial
file behind. One writer per directory across processes (``locked``: every --tensor-parallel rank opens the same
store): the others wait, then read what it wrote. A store without a manifest is incomplete and is
written again, never read. The manifest records the data file's size and CRC-32: a data file of another size (truncated, cut
mid-write) is found at every open and the store written again; ``verify`` reads the whole file against the CRC
(`moe-offload convert` runs it on a store it finds). Each record's CRC-32 is checked at its first read: a record
whose bytes changed on disk (a flipped bit, a same-size overwrite) fails that read (ModelError: the request fails,
the worker lives) and is never served; ``FAILURES_IN_ROW`` failed reads one after another make the engine unhealthy
(``StoreFile.health``: /health answers 503).

A store **in place** has no experts.bin: where the checkpoint already holds each expert's tensors as the engine keeps
them (bf16 safetensors, GGUF expert blocks: contiguous per expert), the manifest lists, per expert, the extents of
the checkpoint's files that make its record (``files`` [{path, size, mtime_ns}], per layer ``extents`` [expert]
[[file, offset, nbytes, record offset]]), and a miss is one pread per extent straight into the host slot (gate and
up side by side make the fused gate|up). The files are read buffered at any offset (no alignment to keep) and the
pages read are dropped from the page cache after (posix_fadvise), so the host cache holds the only copy. A file of
another size or mtime makes the store stale: written again, never read. The manifest is the whole store on disk.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_offload.errors import ModelError

VERSION = 3  # 2: the manifest records the data file's CRC-32; 3: and each record's
FAILURES_IN_ROW = 3  # reads failing one after another (EIO, a corrupt record) that make the store unhealthy
ALIGN = 4096  # record offset, record size and buffer address: the page size, which O_DIRECT asks for
TENSOR_ALIGN = 64  # a tensor's offset inside its record: any dtype's view is aligned
MANIFEST, DATA, LOCK = "store.json", "experts.bin", "store.lock"
RECORD_TENSORS = ("up", "down", "up_scale", "down_scale")  # store.WEIGHT_NAMES without the biases


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name: "bfloat16", "int8", "float8_e4m3fn", "uint8", "float32"
    shape: tuple[int, ...]  # one expert's
    offset: int  # bytes into the record
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class LayerEntry:
    name: str  # the experts module's name in the model
    layer: int
    num_experts: int
    offset: int  # bytes into experts.bin of expert 0's record
    record_bytes: int  # a multiple of ALIGN
    tensors: tuple[TensorEntry | None, ...]  # RECORD_TENSORS order; None: the format has no such tensor
    # in place: per expert the ((file, offset, nbytes, record offset), ...) its record is read from; None: experts.bin
    extents: tuple[tuple[tuple[int, int, int, int], ...], ...] | None = None
    crcs: tuple[int, ...] | None = None  # a copy: each record's CRC-32 (padding included), checked at its first read

    def record_offset(self, e: int) -> int:
        return self.offset + e * self.record_bytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of one expert's tensors (the record without its padding)."""
        return sum(t.nbytes for t in self.tensors if t is not None)

    @property
    def read_bytes(self) -> int:
        """Bytes one read of an expert moves: its record (a copy), its tensors' extents (in place)."""
        return self.payload_bytes if self.extents is not None else self.record_bytes


def layout(tensors: tuple[torch.Tensor | None, ...]) -> tuple[tuple[TensorEntry | None, ...], int]:
    """(entries, record bytes) of one expert's record tensors (RECORD_TENSORS order)."""
    entries, off = [], 0
    for name, t in zip(RECORD_TENSORS, tensors):
        if t is None:
            entries.append(None)
            continue
        n = t.numel() * t.element_size()
        entries.append(TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, n))
        off = _round(off + n, TENSOR_ALIGN)
    return tuple(entries), _round(max(off, 1), ALIGN)


@dataclass(frozen=True)
class Manifest:
    dir: Path
    fmt: str
    data_bytes: int
    meta: dict
    layers: dict[str, LayerEntry]  # by experts module name
    files: tuple[Path, ...] = ()  # in place: the checkpoint files the extents index; () for a copy (experts.bin)

    @property
    def data_path(self) -> Path:
        return self.dir / DATA

    @property
    def in_place(self) -> bool:
        return bool(self.files)

    @property
    def disk_bytes(self) -> int:
        """Bytes the store adds on disk: its data file and manifest (in place: the manifest alone)."""
        return self.data_bytes + (self.dir / MANIFEST).stat().st_size


def read_manifest(directory: Path) -> Manifest | None:
    """The store's manifest, or None when the directory holds no complete store: no manifest (cut mid-write),
    another version, or a data file whose size is not the manifest's (truncated): those are written again, never
    read (a warning names the last). ModelError for a manifest that is not one."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        layers = {}
        for d in doc["layers"]:
            tensors = tuple(None if t is None else TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["offset"],
                                                               t["nbytes"]) for t in d["tensors"])
            ext, crcs = d.get("extents"), d.get("record_crc32")
            layers[d["name"]] = LayerEntry(d["name"], d["layer"], d["num_experts"], d["offset"], d["record_bytes"],
                                           tensors, None if ext is None else tuple(tuple(tuple(x) for x in e)
                                                                                   for e in ext),
                                           None if crcs is None else tuple(int(c) for c in crcs))
        known = {"version", "format", "data_bytes", "layers", "files"}
        files = [(Path(f["path"]), int(f["size"]), int(f["mtime_ns"])) for f in doc.get("files", ())]
        man = Manifest(Path(directory), doc["format"], int(doc["data_bytes"]), {k: v for k, v in doc.items() if k not in known},
                       layers, tuple(f[0] for f in files))
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{path}: not an expert store manifest ({type(e).__name__}: {e}); delete the directory "
                         "to have it written again") from None
    if doc.get("version") != VERSION:
        return None  # another version: written again
    from moe_offload.log import get_logger

    if files:  # in place: every file as it was when the extents were taken
        for f, size, mtime in files:
            st = f.stat() if f.is_file() else None
            if st is None or st.st_size != size or st.st_mtime_ns != mtime:
                get_logger("moe_offload.store").warning("expert store's checkpoint file changed: writing it again",
                                                        store=str(directory), file=str(f))
                return None
        return man
    size = man.data_path.stat().st_size if man.data_path.is_file() else -1
    if size != man.data_bytes:
        get_logger("moe_offload.store").warning("expert store truncated or cut: writing it again", store=str(directory),
                                                bytes=max(size, 0), expected=man.data_bytes)
        return None
    return man


def verify(man: Manifest, chunk: int = 64 << 20) -> bool:
    """Whether the data file's bytes have the CRC-32 the manifest recorded (reads the whole file). A store in place
    has no bytes of its own: its files were checked (size, mtime) when its manifest was read."""
    if man.in_place:
        return True
    crc = 0
    with open(man.data_path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc == man.meta.get("crc32")


def discard(directory: Path) -> None:
    """Make the store at ``directory`` incomplete (its manifest removed): the next ensure writes it again."""
    (Path(directory) / MANIFEST).unlink(missing_ok=True)


class StoreFile:
    """experts.bin (or, in place, the checkpoint's files) open for reads: ``read(entry, e, buf)`` reads expert
    ``e``'s record into ``buf`` (uint8, record bytes, ALIGN-aligned address when O_DIRECT is on). Thread-safe (pread
    has no shared file position). ``keep_cache``: every expert has a host slot for the whole run (the memory plan's
    "every expert fits"): reads go through the page cache and leave it be, as a memory-mapped file's would, so a
    restarted worker reads from memory what the last one read (else: O_DIRECT, or pages dropped after the read)."""

    def __init__(self, manifest: Manifest, direct: bool = True, keep_cache: bool = False):
        self.manifest = manifest
        self.keep_cache = keep_cache
        direct = direct and not keep_cache
        self.verified: set[tuple[str, int]] = set()  # records whose CRC matched at their first read
        self.failed_in_row, self.last_error = 0, ""
        self._lock = threading.Lock()  # the I/O threads count failures
        path = str(manifest.data_path)
        self.direct = False
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self.fds = [os.open(str(f), flags) for f in manifest.files]  # in place: buffered, any offset
        if manifest.in_place:
            self.fd = -1
        elif direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered reads, dropped from the cache after
                self.fd = os.open(path, flags)
        else:
            self.fd = os.open(path, flags)

    def read(self, entry: LayerEntry, e: int, buf: torch.Tensor) -> int:
        """Bytes read (= entry.record_bytes; in place, the record's payload); ModelError naming the layer and expert
        when the file is short or gone, a read fails (EIO) or the record's bytes are not those written."""
        try:
            n = self._read(entry, e, buf)
        except ModelError as err:
            with self._lock:
                self.failed_in_row, self.last_error = self.failed_in_row + 1, str(err)
            raise
        with self._lock:
            self.failed_in_row = 0
        return n

    def health(self) -> str | None:
        """Why the store cannot be trusted now (reads failing one after another), or None."""
        if self.failed_in_row >= FAILURES_IN_ROW:
            return f"the expert store failed {self.failed_in_row} reads in a row (last: {self.last_error})"
        return None

    def _read(self, entry: LayerEntry, e: int, buf: torch.Tensor) -> int:
        view = memoryview(buf.numpy()).cast("B")
        if entry.extents is not None:
            return self._read_extents(entry, e, view)
        off = entry.record_offset(e)
        try:
            n = pread_into(self.fd, view, off)
        except OSError as err:
            raise ModelError(f"{self.manifest.data_path}: reading {entry.name} expert {e} failed: {err}") from None
        if n != entry.record_bytes:
            raise ModelError(f"{self.manifest.data_path}: {entry.name} expert {e}: read {n} of {entry.record_bytes} "
                             "bytes (the expert store is truncated)")
        if not self.direct and not self.keep_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)  # the host cache holds it: no second copy
        if entry.crcs is not None and (entry.name, e) not in self.verified:
            if zlib.crc32(view[:n]) != entry.crcs[e]:
                raise ModelError(f"{self.manifest.data_path}: {entry.name} expert {e} does not match its checksum (the "
                                 f"expert store is corrupt); delete {self.manifest.dir} or run `moe-offload convert` "
                                 "to write it again")
            self.verified.add((entry.name, e))
        return n

    def _read_extents(self, entry: LayerEntry, e: int, view: memoryview) -> int:
        total = 0
        for f, off, n, into in entry.extents[e]:
            try:
                got = pread_into(self.fds[f], view[into: into + n], off)
            except OSError as err:
                raise ModelError(f"{self.manifest.files[f]}: reading {entry.name} expert {e} failed: {err}") from None
            if got != n:
                raise ModelError(f"{self.manifest.files[f]}: {entry.name} expert {e}: read {got} of {n} bytes at "
                                 f"{off} (the checkpoint file is truncated)")
            if not self.keep_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fds[f], off, n, os.POSIX_FADV_DONTNEED)  # the host cache holds it: no 2nd copy
            total += n
        return total

    def close(self) -> None:
        for fd in [self.fd, *self.fds]:
            if fd >= 0:
                os.close(fd)
        self.fd, self.fds = -1, []


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read into ``view`` from ``fd`` at ``offset``: all of them, or fewer where the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is ALIGN-aligned (O_DIRECT's requirement); ``pin``: page-locked
    (CUDA copies from it are asynchronous DMA). Unpinned, no page is committed until written. Not in huge pages
    (loading/hugepages.py): the disk tier runs under a memory limit, where they raised the peak RSS (bench_disk.py)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start: start + nbytes]


def views(entry: LayerEntry, buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(up, down, up_scale, down_scale) viewed in a buffer of records ``buf`` [N, record_bytes] -> each [N, *shape]."""
    out = []
    for t in entry.tensors:
        if t is None:
            out.append(None)
            continue
        n = buf.shape[0]
        out.append(buf[:, t.offset: t.offset + t.nbytes].view(t.torch_dtype).view(n, *t.shape))
    return tuple(out)
