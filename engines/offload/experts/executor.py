"""The offload executor: the experts function every transformers MoE layer calls.

    [router: top_k_index, top_k_weights]  (transformers, unchanged)
      -> [split: hit (expert in a slot) | miss (home: host store)]
      -> [hits on the accelerator || misses by policy: host compute | fetch into a slot, then compute]
      -> [combine in (token, k) order: sum_k w[t,k] * y[t,k]]  (fixed order: deterministic, as transformers)

Legend: T tokens, K top-k, H hidden, E experts, S = T*K routed token-expert pairs.
On CUDA the device work (hits, fetches) is launched first and runs while the
host thread computes the misses, so host compute overlaps accelerator compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moe_offload.engines.offload.experts import approximate, cuda, devices, fused, policies
from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.experts.stats import ExecutorStats
from moe_offload.engines.offload.experts.store import LayerStore
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.kernels.dispatch import expert_forward

IMPLEMENTATION = "moe_offload"
# Marks an experts module the executor does not serve (a vision tower's experts, a layer's image-token experts):
# it runs transformers' own eager forward on its resident weights.
RESIDENT = object()


@dataclass
class LayerState:
    """What one experts module needs at run time (hung on the module as ``_moe_offload``)."""

    executor: "Executor"
    pos: int  # index into executor.layers / stats rows
    layer: int  # decoder layer index (as in the Placement)
    store: LayerStore
    cache: SlotCache
    expert_bytes: int
    events: dict = field(default_factory=dict)  # CUDA: slot -> event after its last use
    fused: dict = field(default_factory=dict)  # (x dtype, x dims, kernels on, grad) -> which fused kernel applies
    cold: LayerStore | None = None  # APPROXIMATE (cold_dtype): the experts in lower precision, computed from on a miss

    @property
    def host_store(self) -> LayerStore:
        """What a miss computed on the host reads: the cold copy when there is one, else the store."""
        return self.cold if self.cold is not None else self.store


def offload_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The function registered as experts implementation ``moe_offload`` (self: the experts module)."""
    state = getattr(self, "_moe_offload", None)
    if state is RESIDENT:
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    if state is None:
        raise RuntimeError(
            "experts_implementation='moe_offload' needs a model loaded by moe_offload.engines.offload.loading.loader.load_model"
        )
    return state.executor.forward(state, self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register the experts implementation with transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, offload_experts_forward)


class Executor:
    """State of the registered experts function for one loaded model.

    ``stats``: ExecutorStats (``snapshot()``, ``reset()``); ``tier_names``: (accelerator tier, host tier);
    ``capture(True)`` records every forward's routes, read back with ``captured()``.
    """

    def __init__(self, device: torch.device, policy: str, tier_names: tuple[str, str], hybrid_threshold: int | None):
        self.device = device
        self.policy = policies.check_policy(policy)
        self.tier_names = tier_names
        self.device_tiers: tuple[str, ...] = (tier_names[0],)  # one tier per accelerator (--devices): slot order
        self.layers: list[LayerState] = []
        self.hybrid_threshold = hybrid_threshold  # None until layers are known (default from the cost estimate)
        self.stats = ExecutorStats([], *tier_names)
        self.timing = True
        self._capturing = False
        self._records: list[dict[int, list[list[int]]]] = []
        self._copiers: dict = {}  # CUDA: one copier (side stream) per device holding slots
        self._cuda = device.type == "cuda"
        self.gather_hits = self._cuda  # a layer's slot hits in one gathered call (experts/cuda.py: launch-bound GPUs)
        # per-token attribution of a batched step (the engine sets per_token when a step holds several sequences):
        # token_stats [T, 2] = routed pairs of each token served from a slot hit / computed on the host
        self.per_token = False
        self.token_stats: torch.Tensor | None = None
        # dry: a forward that must leave no trace (the engine's load-time probe): misses are computed on the host,
        # nothing is fetched or touched, so the slot caches start the first request as the placement left them
        self.dry = False
        # the disk tier (loader, when experts live in the expert store file): its stats, I/O threads, prefetcher
        self.disk = self.io = self.prefetcher = self.store_file = None
        # approximate (opt-in): a token's routed pairs ranked tail_skip or lower (0-based, by router weight) are
        # dropped when their expert is not in a slot (the NPU design's TAIL_SKIP); None: exact
        self.tail_skip: int | None = None
        self.cold_dtype: str | None = None  # the format of the layers' cold copies (LayerState.cold), when they have one
        self.skipped = 0  # pairs dropped so far
        # expert parallel (ranks/parallel.py): (rank, world); this rank computes experts e with e % world == rank,
        # every layer's rows are summed over the ranks (parallel.over_ranks: the others' rows are zero here)
        self.ep: tuple[int, int] | None = None
        self._slot_table = None  # slot_table.SlotTable of the layers' caches, built at its first use

    def slot_table(self):
        """The expert-to-slot table of every layer's cache on the executor's device (experts/slot_table.py)."""
        if self._slot_table is None:
            from moe_offload.engines.offload.experts.slot_table import SlotTable

            self._slot_table = SlotTable([s.cache for s in self.layers], self.device)
        return self._slot_table

    # ---- set-up (loader) ----
    def attach(self, module: torch.nn.Module, layer: int, store: LayerStore, cache: SlotCache) -> LayerState:
        state = LayerState(self, len(self.layers), layer, store, cache, store.expert_bytes)
        self.layers.append(state)
        object.__setattr__(module, "_moe_offload", state)
        return state

    def finish_setup(self) -> None:
        self.stats = ExecutorStats([s.layer for s in self.layers], *self.tier_names, disk=self.disk,
                                   devices=self.device_tiers)
        if len(self.device_tiers) > 1:
            self.stats.copied_fn = lambda: {d: sum(s.cache.fills[i] * s.expert_bytes for s in self.layers)
                                            for i, d in enumerate(self.device_tiers)}
            self.stats.reset()
        if self.hybrid_threshold is None and self.layers:
            s = self.layers[0]
            self.hybrid_threshold = policies.default_hybrid_threshold(s.expert_bytes, s.store.expert_params, self.device.type)
        if self._cuda:
            self._copiers = {self.device: cuda.CudaCopier(self.device)}
            for st in self.layers:
                for d in st.cache.devices:
                    if d not in self._copiers:
                        self._copiers[d] = cuda.CudaCopier(d)

    # ---- route capture ----
    def capture(self, enabled: bool) -> None:
        """Start (clearing earlier records) or stop recording top-k expert ids per forward and layer."""
        if enabled:
            self._records = []
        self._capturing = enabled

    def captured(self) -> list[dict[int, list[list[int]]]]:
        """One dict per forward call: {decoder layer index: top_k_index as [T, K] int lists}."""
        return self._records

    def begin_forward(self) -> None:
        self.token_stats = None
        if self._capturing:
            self._records.append({})

    def end_forward(self, t0: float) -> None:
        """A model forward that began at perf_counter ``t0`` has ended (the module hooks' and the fused path's)."""
        self.stats.forwards += 1
        self.stats.forward_s += time.perf_counter() - t0

    # ---- the per-layer path ----
    def forward(self, state: LayerState, module, hidden_states, top_k_index, top_k_weights):
        T, K = top_k_index.shape
        cache = state.cache
        ids = top_k_index.reshape(-1).tolist()  # S ints (the one host sync per layer on CUDA)
        if self._capturing:
            if not self._records:
                self._records.append({})
            self._records[-1][state.layer] = [ids[i : i + K] for i in range(0, T * K, K)]
        if self.prefetcher is not None:  # start reading the next layer's likely experts while this one computes
            self.prefetcher.after_route(self, state.pos, hidden_states, ids, K)
        if self.tail_skip is not None and K > self.tail_skip and not self.dry:
            top_k_index, top_k_weights, ids = approximate.skip_tail(self, cache, top_k_index, top_k_weights, ids)
            T, K = top_k_index.shape

        # ---- split: group routed pairs by expert, in ascending expert order (fixed) ----
        if T == 1:
            groups = [(e, k, 1) for e, k in sorted(zip(ids, range(K)))]  # top-k ids are distinct
            perm = None
        else:
            groups, perm = by_expert(top_k_index)
        slot_of = cache.slot_of
        hits, fetch, host = [], [], []
        if self.ep is not None:  # only this rank's experts; the rows of the others' stay zero
            rank, world = self.ep
            groups = [g for g in groups if g[0] % world == rank]
        for g in groups:
            s = slot_of[g[0]]
            if s >= 0:
                hits.append((g, s))
            elif not self.dry and policies.fetches(self.policy, g[2], cache.dynamic, self.hybrid_threshold):
                fetch.append(g)
            else:
                host.append(g)
        if not self.dry:
            for _, s in hits:
                cache.touch(s)
        if hits and getattr(state.store, "pending", None):  # slots aliasing host slots still being read in
            state.store.settle([g[0] for g, _ in hits])

        kind = None if self._cuda else fused.kind(state, module, hidden_states)
        if kind is not None:
            return fused.forward(self, state, module, hidden_states, top_k_index, top_k_weights, perm, hits, fetch, host,
                                 quantized=kind == "q")
        rows = _Rows(hidden_states, perm, K)
        proj = (torch.empty if self.ep is None else torch.zeros)(  # the pairs' rows in (token, k) order
            T * K, hidden_states.shape[-1], dtype=state.store.compute_dtype, device=hidden_states.device)
        host_x = cuda.to_host_async(hidden_states) if host and self._cuda else None  # waited for below

        # ---- hits on the accelerator (one token on the CPU: one call for all of them where the kernel applies,
        # e.g. gpt-oss's biased, clamped-SwiGLU experts; rows bit-identical to the per-expert loop) ----
        t1 = time.perf_counter()
        grouped = (dispatch.experts_one_token(module, hidden_states, [cache.weights[s] for _, s in hits])
                   if T == 1 and len(hits) > 1 and not self._cuda else None)
        if grouped is not None:
            for i, (g, _) in enumerate(hits):
                proj[g[1]] = grouped[i]
        elif not (hits and self.gather_hits and self.ep is None
                  and cuda.gathered_hits(self, state, module, hidden_states, top_k_index, ids, proj)):
            for g, s in hits:
                self._compute(state, module, rows, g, cache.weights[s], proj, slot=s)
        t2 = time.perf_counter()

        # ---- misses fetched into dynamic slots (LRU), each computed right after its copy ----
        fetch_compute_s = 0.0
        copied = 0
        for g in fetch:
            s = cache.fetch(g[0], self._copy_fn(state), state.store.expert(g[0]))
            copied += 1
            tc = time.perf_counter()
            self._compute(state, module, rows, g, cache.weights[s], proj, slot=s)
            fetch_compute_s += time.perf_counter() - tc
        t3 = time.perf_counter()

        # ---- misses computed on the host from the store (overlaps the device work launched above on CUDA) ----
        if host:
            hrows = rows if not self._cuda else _Rows(host_x(), perm.cpu() if perm is not None else None, K)
            host_out = [] if self._cuda else None
            for g in host:
                y = expert_forward(module, hrows.select(g), *state.host_store.expert(g[0]), post_norm=not self._cuda)
                if self._cuda:
                    host_out.append((g, y))
                else:
                    self._place(rows, g, y, proj)
            if self._cuda:
                for g, y in host_out:
                    y = y.to(self.device, non_blocking=True)
                    if module.has_post_expert_norm:  # its weights are on the accelerator
                        y = module.post_expert_norm(y)
                    self._place(rows, g, y, proj)
        t4 = time.perf_counter()

        # ---- combine: as transformers does, sum over k of w * y in (token, k) order ----
        result = self.combine(state, proj, hidden_states, top_k_index, top_k_weights, hits, host, copied)
        self.book_stages(t1, t2, t3, t4, fetch_compute_s)
        return result

    def book_resident(self, states: list[LayerState], ids: torch.Tensor, experts_s: float) -> None:
        """Book a decode step that ran every layer in one call with all experts resident (model/decode_step.py):
        ids [L, T, K] the routes of ``states``' layers; each pair a slot hit, as ``forward`` books it."""
        L, T, K = ids.shape
        multi = len(self.device_tiers) > 1
        self.stats.whole_steps += 1
        # expert parallel: this rank's pairs (the ranks' counts are summed when the forward is booked)
        mine = None if self.ep is None else ids % self.ep[1] == self.ep[0]  # [L, T, K]
        if multi:
            self.token_stats = None
            for st, routes in zip(states, ids):
                self.stats.add(st.pos, T * K, 0, 0, 0, 0, devices.pairs_by_device(st.cache, routes))
                if self.per_token and T > 1:
                    devices.count_tokens(self, st.cache, routes, None, [])
        else:
            pairs = [T * K] * L if mine is None else mine.sum(dim=(1, 2)).tolist()  # per layer, in one op
            for st, n in zip(states, pairs):
                self.stats.add(st.pos, n, 0, 0, 0, 0)
        if self.per_token and T > 1 and not multi:
            self.token_stats = torch.zeros(T, 2, dtype=torch.int64)
            self.token_stats[:, 0] = L * K if mine is None else mine.sum(dim=(0, 2))
        if self._capturing:
            if not self._records:
                self._records.append({})
            for st, routes in zip(states, ids.tolist()):
                self._records[-1][st.layer] = routes
        if self.timing:
            self.stats.stage_s["device_experts"] += experts_s

    def close(self) -> None:
        """Stop the disk tier's I/O threads (reads in flight finish first)."""
        if self.io is not None:
            self.io.shutdown()

    # ---- the per-tier hooks a kernel path (fused.py) calls: combine, book ----
    def book_stages(self, t1, t2, t3, t4, fetch_compute_s):
        """Book a layer's stage times: hits [t1, t2) and the compute of fetched experts are device time, the rest of
        [t2, t3) is fetching, [t3, t4) host experts."""
        if self.timing:
            st = self.stats.stage_s
            st["device_experts"] += (t2 - t1) + fetch_compute_s
            st["fetch"] += (t3 - t2) - fetch_compute_s
            st["host_experts"] += t4 - t3

    def combine(self, state, proj, hidden_states, top_k_index, top_k_weights, hits, host, fetched):
        """sum_k w[t,k] * y[t,k] over proj [S, H] in (token, k) order (as transformers does), and the layer's counts."""
        T, K = top_k_index.shape
        if self.ep is not None:  # every rank's rows: each one computed on exactly one rank (x + 0 = x)
            proj = devices.all_ranks(proj)
        result = weighted_sum(proj, top_k_weights, hidden_states.dtype)
        hit_pairs = sum(g[2] for g, _ in hits)
        if self.per_token and T > 1:
            devices.count_tokens(self, state.cache, top_k_index, hits, [g[0] for g in host])
        routed = T * K if self.ep is None else int((top_k_index % self.ep[1] == self.ep[0]).sum())  # this rank's
        self.stats.add(state.pos, hit_pairs, routed - hit_pairs, sum(g[2] for g in host), fetched,
                       fetched * state.expert_bytes,
                       state.cache.device_pairs(hits) if len(self.device_tiers) > 1 else None)
        return result

    def _compute(self, state, module, rows, g, weights, proj, slot):
        x = rows.select(g)
        home = weights[0].device
        if home != x.device:  # a slot on another accelerator: the rows go there, the outputs come back
            y = expert_forward(module, x.to(home, non_blocking=True), *weights).to(x.device, non_blocking=True)
        else:
            y = expert_forward(module, x, *weights)
        self._place(rows, g, y, proj)
        if self._cuda and slot >= 0:
            state.events[slot] = self._copiers[home].record()

    @staticmethod
    def _place(rows, g, y, proj):
        if rows.perm is None:
            proj[g[1]] = y[0]  # T == 1: g = (expert, k, 1)
        else:
            proj.index_copy_(0, rows.positions(g), y.to(proj.dtype))

    def _copy_fn(self, state):
        if self._cuda:
            return lambda slot, dst, src: self._copiers[dst[0].device].copy(dst, src, state.events.get(slot))
        return fused.copy_sync


def by_expert(top_k_index: torch.Tensor) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """The routed pairs of top_k_index [T, K] grouped by expert, in ascending expert order (fixed): groups
    (expert, start, count) into perm [S], the pairs' flat (token, k) indices sorted by expert (stable)."""
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # [S]
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    groups, start = [], 0
    for e, c in zip(uniq.tolist(), counts.tolist()):
        groups.append((e, start, c))
        start += c
    return groups, perm


def weighted_sum(proj: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum over k of w[t, k] * y[t, k]: the pairs' rows proj [T * K, H] in (token, k) order, weights [T, K] -> [T, H]
    in ``dtype`` (the order and roundings transformers' combine has)."""
    T, K = weights.shape
    return (proj * weights.reshape(-1, 1)).view(T, K, -1).sum(dim=1).to(dtype)


class _Rows:
    """Which hidden-state rows a group of routed pairs reads and where its outputs go."""

    def __init__(self, x, perm, K):
        self.x, self.perm = x, perm
        self.tok = perm // K if perm is not None else None  # [S] token of each sorted pair

    def select(self, g):
        e, start, n = g
        if self.perm is None:  # T == 1: every group is the one token
            return self.x
        return self.x.index_select(0, self.tok[start : start + n])  # [n, H]

    def positions(self, g):  # g = (expert, start, n)
        return self.perm[g[1] : g[1] + g[2]]
