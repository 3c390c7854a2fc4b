"""Decode steps of the owned graph as captured CUDA graphs, per bucket, with the same pieces run eagerly as their twin.

    DecodeCapture.build(runner, max_seqs, max_len) -> None (the reason logged) | a capture
    forward(sched) -> logits [B, V] | None (the shape is in no bucket: the graph runs the step eagerly, as always)
      bucket: batch  B -> the smallest of BATCH_BUCKETS >= B (<= max_seqs, and its pairs' weights <= GATHER_MAX_BYTES)
              context    -> the smallest power of two of blocks >= the longest sequence's (<= max_len's blocks)
      StaticStep (one per bucket): ids, pos, lens [Bb], slots [Bb] (the new KV rows), gather [Bb * L] (each row's key
          rows, padded with its own first row), mask [Bb, 1, 1, L]; rows past B write and read one scratch row of the
          pool (softmax attention and MLA's latent rows alike)
      pieces: the step cut at each split layer (split_layers: a MoE layer whose experts are not all pinned)
          piece 0      embed, rotary, layers up to the first split layer's router -> (h, x2, ids, w)
          host l       the router's ids read back once; lru: misses fetched into slots (the slot table synced),
                       a miss whose slot this step's own experts hold: computed from the store; static/hybrid: misses
                       computed on the host (hybrid: fetched where the policy says) -> rows [Bb * K, H]
          piece l + 1  layer l's experts from the slots (slot_experts) + the host's rows, its shared expert, the
                       residual, the next layers ... -> the next split, or the final norm and head -> logits [Bb, V]
      on CUDA each piece is captured once per bucket (a warm-up run, then torch.cuda.CUDAGraph, one memory pool) and
      replayed; elsewhere (the CPU in tests) the same pieces run eagerly on the same buffers: the eager twin.

Why: on a GPU the graph's step is ~1,000 kernel launches a token and the host issuing them is the bottleneck
(docs/benchmarks/gpu.md); a replay issues them in one call. A captured step must not decide on the host: the slot
table (experts/slot_table.py) is read on the device, routes go to the host only at a split, and every shape is a
bucket's. Every routed pair of a piece is computed from the stacked slot buffers (a pair whose expert is missing: the
host's row), combined as the executor combines (sum over k of w * y, in (token, k) order).

Not captured (the graph runs those steps eagerly; build() says why): prefill chunks, drafts, prompt logprobs,
gated-DeltaNet layers (their decode reads host lists), a MoE block run as its module, slots that alias the host store
(the CPU's) or hold quantized experts, several devices, ranks, the disk tier, approximate modes, dynamic rope scaling.
Legend: B sequences of the step, Bb its bucket, L key rows per sequence (the context bucket's), K top-k, H hidden,
V vocabulary, E experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moe_offload.engines.offload.experts import policies
from moe_offload.engines.offload.experts.cuda import GATHER_MAX_BYTES, slot_rows
from moe_offload.engines.offload.experts.executor import weighted_sum
from moe_offload.engines.offload.kernels.dispatch import expert_forward
from moe_offload.engines.offload.loading import quant
from moe_offload.engines.offload.model import blocks
from moe_offload.engines.offload.runtime import kv
from moe_offload.log import get_logger

log = get_logger("moe_offload.capture")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(n: int, max_seqs: int) -> int | None:
    """The batch bucket of a step of ``n`` sequences: the smallest bucket >= n (the largest is max_seqs itself when
    it lies between two buckets); None beyond max_seqs."""
    if not 1 <= n <= max_seqs:
        return None
    return min([b for b in BATCH_BUCKETS if b >= n] + [max_seqs])


def context_bucket(blocks: int, max_blocks: int) -> int | None:
    """The context bucket of a step whose longest sequence holds ``blocks`` blocks: the smallest power of two >= it,
    at most max_blocks (the pool's blocks for the longest sequence); None beyond."""
    if not 1 <= blocks <= max_blocks:
        return None
    return min(1 << (blocks - 1).bit_length(), max_blocks)


def split_layers(layers) -> list[int]:
    """The graph layers a captured step is cut at: MoE layers whose experts are not every one pinned (a step there may
    route to a miss, which the host resolves between two pieces)."""
    return [i for i, lay in enumerate(layers)
            if lay.moe is not None and lay.moe.state.cache.pinned_weights(None) is None]


def slot_experts(table, state, module, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                 missed: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE layer's routed experts for rows x [T, H] without the host: each pair's slot from the device's slot table
    (ids [T, K]), its weights gathered from the stacked slot buffers (dispatch.experts_gathered), a missing pair's row
    from ``missed`` [T * K, H] (zeros: none); combined as Executor.combine, sum over k of w * y -> [T, H]."""
    y, hit = slot_rows(table, state, module, x, ids)
    y = y.to(state.store.compute_dtype)
    proj = torch.where(hit.unsqueeze(1), y, missed if missed is not None else torch.zeros_like(y))
    return weighted_sum(proj, w, x.dtype)


def refuse(runner) -> str:
    """Why decode steps of this runner cannot be captured ("" when they can)."""
    g, ex = runner.graph, runner.executor
    if g is None:
        return "no owned graph"
    if ex is None or ex.ep is not None or len(ex.device_tiers) > 1:
        return "no executor, ranks or several devices"
    if any(x is not None for x in (ex.prefetcher, ex.store_file, ex.tail_skip, ex.cold_dtype)):
        return "the disk tier or an approximate mode (host decisions each step)"
    if runner.pool.codes is not None:
        return "a quantized KV cache"
    if getattr(g.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return "a rope scaling chosen on the host per step"
    for i, lay in enumerate(g.layers):
        if not isinstance(lay.attention, (blocks.AttentionBlock, blocks.MLABlock)):
            return f"layer {i}: gated-DeltaNet layers (their decode reads host lists)"
        d = g.desc.layers[i].ffn
        if lay.moe is None and hasattr(d, "router"):
            return f"layer {i}: a MoE block run as its module"
        if lay.moe is not None:
            stacked = lay.moe.state.cache.stacked
            if stacked is None or stacked[0].dtype in quant.FORMAT_OF_DTYPE:
                return f"layer {i}: slots that alias the host store or hold quantized experts"
    return ""


@dataclass(frozen=True)
class Bucket:
    batch: int
    blocks: int


class StaticStep:
    """The input buffers of one bucket, on the device, and the step layout (kv.StepContext) over them."""

    def __init__(self, bucket: Bucket, pool: kv.KVPool, scratch: int):
        B, L, dev = bucket.batch, bucket.blocks * pool.block_size, pool.device
        self.bucket, self.L, self.scratch, self.bs = bucket, L, scratch, pool.block_size
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.full((B,), scratch, dtype=torch.long, device=dev)
        self.gather = torch.full((B * L,), scratch, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, 1, 1, L, dtype=torch.bool, device=dev)
        self.lens = torch.ones(B, dtype=torch.long, device=dev)
        self.keep = torch.arange(B, device=dev)
        self.step = kv.StepContext(self.slots, [kv.SeqSlice(b, 1, 1) for b in range(B)], pool=pool,
                                   gather=self.gather, decode=list(range(B)), lmax=L, decode_rows=self.keep,
                                   decode_mask=self.mask, decode_pos=self.pos, decode_lens=self.lens)

    def fill(self, ids: list[int], lens: list[int], blocks: list[list[int]]) -> None:
        """The step's B sequences into the first B rows (lens[b]: its context including the new token); the other
        rows write and read the scratch row, attending to it alone."""
        B, L, bs = self.bucket.batch, self.L, self.bs
        n = len(ids)
        pos = torch.zeros(B, dtype=torch.long)
        pos[:n] = torch.tensor(lens) - 1
        slots = torch.full((B,), self.scratch, dtype=torch.long)
        gather = torch.full((B, L), self.scratch, dtype=torch.long)
        ar = torch.arange(L)
        for b, (length, blk) in enumerate(zip(lens, blocks)):
            rows = (torch.tensor(blk).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:length]  # [length]
            slots[b] = rows[-1]
            gather[b, :length] = rows
            gather[b, length:] = rows[0]  # masked: the sequence's own first row keeps the padding finite
        lens_t = torch.ones(B, dtype=torch.long)
        lens_t[:n] = torch.tensor(lens)
        self.ids.zero_()
        self.ids[:n].copy_(torch.tensor(ids))
        self.pos.copy_(pos)
        self.slots.copy_(slots)
        self.gather.copy_(gather.reshape(-1))
        self.mask.copy_((ar.unsqueeze(0) < lens_t.unsqueeze(1))[:, None, None, :])
        self.lens.copy_(lens_t)


class _Piece:
    """One captured run of the step: ``fn()`` -> a dict of tensors. On CUDA captured at its first call (after one
    warm-up run on a side stream) and replayed after; elsewhere run eagerly each call."""

    def __init__(self, fn, device: torch.device, mempool):
        self.fn, self.device, self.mempool = fn, device, mempool
        self.graph, self.out = None, None

    def __call__(self) -> dict:
        if self.device.type != "cuda":
            return self.fn()
        if self.graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.mempool):
                self.out = self.fn()
        self.graph.replay()
        return self.out


class DecodeCapture:
    """Decode-only steps of ``runner.graph`` in buckets of static shapes, cut at the split layers."""

    def __init__(self, runner, max_seqs: int, max_len: int):
        self.runner, self.graph, self.executor = runner, runner.graph, runner.executor
        self.pool, self.device = runner.pool, runner.device
        self.max_seqs, self.max_blocks = max_seqs, self.pool.blocks_for(max_len)
        self.splits = split_layers(self.graph.layers)
        # a piece gathers every routed pair's weights (slot_experts): the largest batch whose pairs stay within what
        # the executor's gathered path reads at once (experts/cuda.py); beyond it the graph runs the step eagerly
        moe = [lay.moe for lay in self.graph.layers if lay.moe is not None]
        pair = max((m.state.expert_bytes * m.top_k for m in moe), default=0)
        self.max_batch = max_seqs if pair == 0 else min(max_seqs, GATHER_MAX_BYTES // pair)
        self.table = self.executor.slot_table()
        self.scratch = self.pool.allocate(1)[0] * self.pool.block_size  # padding rows' KV row, held for good
        self.mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.buckets: dict[Bucket, tuple[StaticStep, list[_Piece], dict]] = {}
        self.steps = 0

    @classmethod
    def build(cls, runner, max_seqs: int, max_len: int, *, eager: bool = False) -> "DecodeCapture | None":
        """The capture for ``runner``'s decode steps on CUDA (``eager``: anywhere, the pieces run eagerly: tests), or
        None with the reason logged."""
        why = "not a CUDA device" if runner.device.type != "cuda" and not eager else refuse(runner)
        if why:
            log.info("captured decode off: decode steps run the graph eagerly", reason=why)
            return None
        cap = cls(runner, max_seqs, max_len)
        log.info("captured decode on", splits=len(cap.splits), layers=len(cap.graph.layers),
                 eager=runner.device.type != "cuda")
        return cap

    def bucket(self, lens: list[int]) -> Bucket | None:
        b = batch_bucket(len(lens), self.max_seqs)
        if b is not None and b > self.max_batch:  # the bucket's pairs would gather more weights than the cap
            return None
        n = context_bucket(self.pool.blocks_for(max(lens)), self.max_blocks) if lens else None
        return None if b is None or n is None else Bucket(b, n)

    def forward(self, ids: list[int], lens: list[int], blocks: list[list[int]]) -> torch.Tensor | None:
        """One decode token per sequence (lens[b]: its context including the token, blocks[b] its block table):
        logits [B, V], or None where the step is in no bucket (the caller runs the graph eagerly)."""
        bucket = self.bucket(lens)
        if bucket is None:
            return None
        st, pieces, carry = self.buckets.get(bucket) or self._add(bucket)
        ex, B = self.executor, len(ids)
        t0 = time.perf_counter()
        ex.begin_forward()
        st.fill(ids, lens, blocks)
        routes = []  # (states, ids [Lr, Bb, K]) of the pinned layers, booked as whole-step hits
        for p, piece in enumerate(pieces):
            carry.update(piece())
            routes.append(carry["routes"])
            if p < len(self.splits):
                self._host(self.graph.layers[self.splits[p]], carry, B)
        self._book(routes, B)
        if self.splits:  # per-token attribution of the split layers' pairs is not kept: the step's shares stand
            ex.token_stats = None
        logits = carry["logits"][:B].clone()  # the next replay writes the static output again
        ex.end_forward(t0)
        self.steps += 1
        return logits

    # -- the pieces -------------------------------------------------------------------------------------------------
    def _add(self, bucket: Bucket):
        st = StaticStep(bucket, self.pool, self.scratch)
        carry: dict = {}
        cuts = [-1, *self.splits, len(self.graph.layers)]
        pieces = [_Piece(self._piece_fn(st, carry, cuts[i], cuts[i + 1]), self.device, self.mempool)
                  for i in range(len(cuts) - 1)]
        self.buckets[bucket] = (st, pieces, carry)
        log.info("decode bucket", batch=bucket.batch, blocks=bucket.blocks, pieces=len(pieces))
        return self.buckets[bucket]

    def _piece_fn(self, st: StaticStep, carry: dict, after: int, split: int):
        """The piece from the split layer ``after``'s experts (-1: the embedding) through layer ``split``'s router
        (len(layers): through the head)."""
        g, table = self.graph, self.table
        last = split == len(g.layers)

        def fn() -> dict:
            if after < 0:
                h, rot = g.embed_rows(st.ids, st.pos)
            else:  # the split layer's experts: the slots', the host's rows where a pair missed
                rot = g.rotary_tables(carry["h"], st.pos)
                moe = g.layers[after].moe
                out = slot_experts(table, moe.state, moe.experts, carry["xe"], carry["ids"], carry["w"],
                                   carry["missed"])
                h = g.residual(carry["h"], moe.finish(carry["x2"], out))
            routes = []
            for i in range(after + 1, split + (0 if last else 1)):
                lay = g.layers[i]
                h, x2 = g.attention_half(lay, h, rot, st.step)
                if lay.moe is None:
                    h = g.residual(h, lay.ffn(x2))
                    continue
                ids, w, xe = lay.moe.route(x2)
                if i == split:
                    return {"h": h, "x2": x2, "ids": ids, "w": w, "xe": xe, "routes": routes}
                routes.append((lay.moe.state, ids))
                h = g.residual(h, lay.moe.finish(x2, slot_experts(table, lay.moe.state, lay.moe.experts, xe, ids,
                                                                  w)))
            return {"logits": g.head(h), "routes": routes}

        return fn

    def _host(self, lay, carry: dict, B: int) -> None:
        """Between two pieces: the split layer's routes of the step's B rows read back; its misses fetched into slots
        or computed from the host store, as the executor decides them (hits touched first, then each miss in expert
        order); the layer's pairs booked as the executor books them."""
        ex, state, module = self.executor, lay.moe.state, lay.moe.experts
        cache, K, xe = state.cache, carry["ids"].shape[1], carry["xe"]
        ids = carry["ids"][:B].reshape(-1).tolist()  # the piece's one host sync
        counts = {e: ids.count(e) for e in sorted(set(ids))}
        missed = torch.zeros(xe.shape[0] * K, xe.shape[1], dtype=state.store.compute_dtype, device=xe.device)
        xh = []

        def rows_of(e: int, weights: tuple, on_host: bool) -> None:  # this step's pairs of e, into missed
            pairs = [p for p, x in enumerate(ids) if x == e]
            if on_host and not xh:
                xh.append(xe[:B].to("cpu"))
            x = xh[0] if on_host else xe
            y = expert_forward(module, x.index_select(0, torch.tensor(pairs, device=x.device) // K), *weights,
                               post_norm=not on_host)
            if on_host:
                y = y.to(missed.device, non_blocking=True)
                if module.has_post_expert_norm:  # its weights are where the layer runs
                    y = module.post_expert_norm(y)
            missed.index_copy_(0, torch.tensor(pairs, device=missed.device), y.to(missed.dtype))

        misses = [e for e in counts if cache.slot_of[e] < 0]
        hits = sum(n for e, n in counts.items() if cache.slot_of[e] >= 0)
        for e in counts:
            if cache.slot_of[e] >= 0:
                cache.touch(cache.slot_of[e])
        host = fetched = 0
        for e in misses:
            if policies.fetches(ex.policy, counts[e], cache.dynamic, ex.hybrid_threshold):
                v = cache.victim()
                old = cache.expert_in[v]
                if old in counts and cache.slot_of[old] == v:  # the executor computed it before this fetch: so here
                    rows_of(old, cache.weights[v], on_host=False)
                    if ex._cuda:  # the copy into v waits for those rows
                        state.events[v] = ex._copiers[xe.device].record()
                cache.fetch(e, ex._copy_fn(state), state.store.expert(e))
                fetched += 1
            else:
                rows_of(e, state.host_store.expert(e), on_host=True)
                host += counts[e]
        self.table.sync(state.pos)
        if "missed" in carry:  # a captured piece reads this tensor: the rows go into it
            carry["missed"].copy_(missed)
        else:
            carry["missed"] = missed
        ex.stats.add(state.pos, hits, B * K - hits, host, fetched, fetched * state.expert_bytes)

    def _book(self, routes: list, B: int) -> None:
        """The pinned layers' pairs of the step's B rows: slot hits, booked as the whole-step call books them."""
        pairs = [(st, ids[:B]) for piece in routes for st, ids in piece]
        if pairs:
            self.executor.book_resident([st for st, _ in pairs], torch.stack([i for _, i in pairs]).cpu(), 0.0)
