"""Host DRAM as an expert cache over the disk store: the tier between the accelerator slots and the expert store file.

    request(experts) -> ready (in a host slot) | loading (a slot reserved now, its record read by the I/O pool)
    prefetch(experts) -> reads started for the predicted experts of a layer that has not run yet
    wait(e) -> views once its read is done (the time spent waiting is the stall)

Per MoE layer: C slots of one record each ([C, record_bytes], ALIGN-aligned, the diskstore layout, so an expert's
tensors are views of the bytes read). ``pinned`` experts (the placement's resident experts on a CPU accelerator,
whose slots alias these) are read once and never evicted; the other slots are an LRU. Pinned experts are read in
the background from the start (the warm-up, on the prefetch thread, layer after layer); one a forward needs
before its turn is moved to the demand threads, so the first token waits only for the experts it routes to, as a
memory-mapped file's first touch would, but with one large read per expert. A cache per layer is deliberate:
each token walks the layers in the same order, and a global LRU (the page cache's) evicts
the layer that comes next; a share per layer does not.

Legend: E experts, C host slots of the layer, P pinned experts, D = C - P dynamic slots.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moe_offload.engines.base import disk_rates
from moe_offload.engines.offload.experts import diskstore
from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.experts.tiercache import TierSlots

# host_hits: experts asked for that were in a slot (or on their way, prefetched); demand_reads: asked for, not there,
# read then. disk_reads/disk_bytes: reads done (demand + prefetch). predicted/predicted_used/routed_experts: the
# prefetcher's guesses for a layer, how many the router then chose, and how many it chose (precision, recall).
# prefetch_cancelled: prefetches still queued when their layer ran (dropped: a read that had not started saves nothing).
# warmup_promoted: pinned experts a forward needed before their background read started (read on demand instead).
COUNTERS = ("host_hits", "demand_reads", "disk_reads", "disk_bytes", "prefetch_reads", "prefetch_hits",
            "prefetch_cancelled", "prefetch_wasted_bytes", "predicted", "predicted_used", "routed_experts",
            "warmup_promoted")


class DiskStats:
    """The disk tier's counters, shared by every layer's cache; ``stall_s``: time the forward waited for reads."""

    def __init__(self):
        self.lock = threading.Lock()  # the I/O threads count too
        self.reset()

    def reset(self) -> None:
        # the share of recent prefetch reads a layer then used (each resolved read weighs 1/32); it starts just below
        # the prefetcher's gate, so prefetching begins as probes and opens once they are used
        self.prefetch_useful = 0.49
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.stall_s = 0.0
        self.read_s = 0.0  # summed over the I/O threads (reads overlap: can exceed wall time)

    def snapshot(self) -> dict:
        c = dict(self.counts)
        c.update(disk_rates(c))
        c["stall_ms"] = self.stall_s * 1000
        c["read_ms"] = self.read_s * 1000
        c["read_gb_per_s"] = c["disk_bytes"] / self.read_s / 1e9 if self.read_s else 0.0
        return c


class IOPool:
    """Threads that read records (``os.preadv`` releases the GIL: reads overlap compute and each other). Reads a
    layer asks for (demand) have ``threads`` threads; prefetches queue on one thread of their own, so a wrong guess
    never stands in front of a read the forward is waiting for, and the disk's spare time is what prefetch uses."""

    def __init__(self, threads: int = 8):
        self.demand = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moe-offload-io")
        self.ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-prefetch")

    def submit(self, fn, *args, prefetch: bool = False) -> Future:
        return (self.ahead if prefetch else self.demand).submit(fn, *args)

    def shutdown(self) -> None:
        self.ahead.shutdown(wait=True, cancel_futures=True)
        self.demand.shutdown(wait=True, cancel_futures=True)


class CachedLayerStore(LayerStore, TierSlots):
    """One layer's experts in C host slots over its records in the store file. ``tensors`` are the slots' views
    ([C, ...], so format and per-expert bytes read as a LayerStore's); ``expert(e)`` returns expert e's views, reading
    it first when it is not in a slot. ``biases``: (up_bias [E, 2I] | None, down_bias [E, H] | None), in memory."""

    def __init__(self, file: diskstore.StoreFile, entry: diskstore.LayerEntry, slots: int, pinned: list[int],
                 biases: tuple, compute_dtype: torch.dtype, io: IOPool, stats: DiskStats, pin: bool = False):
        if not len(pinned) <= slots <= entry.num_experts:
            raise ValueError(f"{entry.name}: {slots} host slots for {len(pinned)} pinned of {entry.num_experts} experts")
        self.file, self.entry, self.io, self.disk = file, entry, io, stats
        # pinned on CUDA: fetches into the accelerator's slots copy from here by DMA
        self.buf = diskstore.aligned_empty(slots * entry.record_bytes, pin=pin).view(slots, entry.record_bytes)
        up, down, us, ds = diskstore.views(entry, self.buf)
        self.ub, self.db = biases
        # biases stay [E, ...] in memory (small); the weights are [C, ...] slot views
        super().__init__((up, down, self.ub, self.db, us, ds), compute_dtype)
        self._E = entry.num_experts
        self._init_slots(self._E, pinned, slots)
        self.pending: dict[int, Future] = {}  # slot -> read in flight
        self.unused_prefetch: set[int] = set()  # slots filled by a prefetch and not asked for yet
        self._lock = threading.Lock()
        self.warming: set[int] = set()  # pinned slots whose background read is queued or running
        for s, e in enumerate(self.pinned):
            self.pending[s] = io.submit(self._read, s, e, prefetch=True)
            self.warming.add(s)

    # ---- what a LayerStore answers ----
    @property
    def num_experts(self) -> int:
        return self._E

    @property
    def nbytes(self) -> int:
        """Host bytes this layer holds (its slots, records as stored)."""
        return self.num_slots * self.entry.record_bytes

    @property
    def disk_bytes(self) -> int:
        return self._E * self.entry.record_bytes

    def expert(self, e: int) -> tuple[torch.Tensor | None, ...]:
        """Expert ``e``'s (up, down, up_bias, down_bias, up_scale, down_scale), read now when not in a slot. The views
        stay valid until ``dynamic`` other experts are asked for (callers use them before asking for more)."""
        ready, loading = self.request([e])
        return self.wait(e) if loading else self.views(e)

    def views(self, e: int) -> tuple[torch.Tensor | None, ...]:
        s = self.slot_of[e]
        up, down, _, _, us, ds = self.tensors
        return (up[s], down[s], self.ub[e] if self.ub is not None else None, self.db[e] if self.db is not None else None,
                us[s] if us is not None else None, ds[s] if ds is not None else None)

    # ---- the cache ----
    def request(self, experts: list[int]) -> tuple[list[int], list[int]]:
        """(experts ready in a slot, experts whose reads were started or were already in flight); at most ``dynamic``
        experts not pinned may be asked for at once (the executor chunks), so none evicts another of the same call."""
        ready, loading = [], []
        with self._lock:
            self._drop_queued_prefetches()
            self._promote(experts)
            self._score_prefetches(experts)
            for e in experts:  # first mark every resident one used, so the reads below evict none of them
                s = self.slot_of[e]
                if s >= 0:
                    self._use(s)
                    (loading if s in self.pending else ready).append(e)
            hits = len(ready) + len(loading)
            for e in experts:
                if self.slot_of[e] < 0:
                    self._start(e, prefetch=False)
                    loading.append(e)
            with self.disk.lock:
                self.disk.counts["host_hits"] += hits
                self.disk.counts["demand_reads"] += len(loading) + len(ready) - hits
        return ready, loading

    def prefetch(self, experts: list[int]) -> int:
        """Start reads for predicted experts not in a slot (at most ``dynamic``, the first ones); returns reads started."""
        started = 0
        with self._lock:
            for e in experts[: self.dynamic]:
                if self.slot_of[e] < 0:
                    self._start(e, prefetch=True)
                    started += 1
        return started

    def wait(self, e: int, retry: bool = True) -> tuple[torch.Tensor | None, ...]:
        s = self.slot_of[e]
        if s in self.pending:
            t0 = time.perf_counter()
            err = self._settle(s)
            self.disk.stall_s += time.perf_counter() - t0
            if err is not None and retry:  # a read may have failed before its file was mended (a prefetch, or a
                self.request([e])  # read of a request that failed first): read once more, now
                return self.wait(e, retry=False)
            if err is not None:
                raise err  # the read's ModelError, in the request that needed the expert
        return self.views(e)

    def _settle(self, s: int) -> BaseException | None:
        """Wait for slot ``s``'s read. A failed read empties the slot (its bytes are not the expert's) and is returned."""
        fut = self.pending.pop(s, None)
        if fut is None:
            return None
        try:
            fut.result()
            return None
        except Exception as err:  # noqa: BLE001 - handed to the caller that needs this expert
            self.release(s)
            self.unused_prefetch.discard(s)
            return err

    def settle(self, experts: list[int]) -> None:
        """Wait until ``experts`` (in slots: pinned ones, which the accelerator's slots alias) are read in."""
        with self._lock:
            self._promote(experts)
        for e in experts:
            s = self.slot_of[e]
            if s >= 0 and s in self.pending:
                self.wait(e)

    def _promote(self, experts: list[int]) -> None:
        """Warm-up reads of ``experts`` that have not started move to the demand threads (a forward needs them)."""
        if not self.warming:
            return
        for e in experts:
            s = self.slot_of[e]
            if s in self.warming:
                fut = self.pending.get(s)
                if fut is None or fut.done():
                    self.warming.discard(s)
                elif fut.cancel():
                    self.pending[s] = self.io.submit(self._read, s, e)
                    self.warming.discard(s)
                    self.disk.counts["warmup_promoted"] += 1

    def _score_prefetches(self, experts: list[int]) -> None:
        """A prefetch was for this run of the layer: one it did not ask for now counts as wasted (its slot stays an
        ordinary LRU entry), so the usefulness the prefetcher is gated on follows each step, not each eviction."""
        if not self.unused_prefetch:
            return
        asked = set(experts)
        for s in list(self.unused_prefetch):
            if self.expert_in[s] not in asked:
                self.unused_prefetch.discard(s)
                self.disk.counts["prefetch_wasted_bytes"] += self.entry.record_bytes
                self.disk.prefetch_useful -= self.disk.prefetch_useful / 32

    def _drop_queued_prefetches(self) -> None:
        """The layer runs now: a prefetch whose read has not started saves nothing. Drop it and free its slot (first in
        line for reuse); an expert the layer needs is then read as a demand read, on the demand threads."""
        for s in list(self.unused_prefetch):
            fut = self.pending.get(s)
            if fut is not None and fut.cancel():
                del self.pending[s]
                self.unused_prefetch.discard(s)
                self.release(s)
                self.disk.counts["prefetch_cancelled"] += 1

    def _use(self, s: int) -> None:
        if s in self.lru:
            self.lru.move_to_end(s)
        if s in self.unused_prefetch:
            self.unused_prefetch.discard(s)
            self.disk.counts["prefetch_hits"] += 1
            self.disk.prefetch_useful += (1.0 - self.disk.prefetch_useful) / 32

    def _start(self, e: int, prefetch: bool) -> None:
        s = self.victim()
        self._settle(s)  # the slot's previous read must land before its buffer is reused (if it failed: emptied)
        if s in self.unused_prefetch:  # a prefetched expert evicted before any layer asked for it
            self.unused_prefetch.discard(s)
            self.disk.counts["prefetch_wasted_bytes"] += self.entry.record_bytes
            self.disk.prefetch_useful -= self.disk.prefetch_useful / 32
        self.claim(e)
        if prefetch:
            self.unused_prefetch.add(s)
            self.disk.counts["prefetch_reads"] += 1
        self.pending[s] = self.io.submit(self._read, s, e, prefetch=prefetch)

    def _read(self, s: int, e: int) -> None:
        t0 = time.perf_counter()
        n = self.file.read(self.entry, e, self.buf[s])
        with self.disk.lock:
            self.disk.read_s += time.perf_counter() - t0
            self.disk.counts["disk_reads"] += 1
            self.disk.counts["disk_bytes"] += n

