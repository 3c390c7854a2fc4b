"""The model runner: one step's forward, and the input layout it needs.

    SchedulerOutput [(sequence, n tokens)]
      paged:  every token of the step packed into one forward [1, N]: ids, positions, slot_mapping [N] (pool rows
              of the new KV), the key layout (layout(): decode sequences first, each padded to the longest, then
              each prefill chunk's context) --model + PagedCache (kv.py)--> logits of the kept rows [R, V]
      graph:  the same packed step through the model graph of our own (model/graph.py), built from the description:
              ids, positions, the step's layout passed in --> logits of the kept rows [R, V]; where the graph has no
              block for a layer kind, transformers' modules run the step over the same PagedCache (kv.active)
      fused:  a step where every sequence computes one token (+ its draft: rows at consecutive positions), on a
              model whose description (control/description.py) the fused path computes --DecodePlan (model/fastpath.py;
              MLA layers: mla_plan.py), chosen once in decode_plan()--> logits [B, V]
      each:   a model with state beyond attention KV: one forward per sequence on its own cache
    around each forward: the executor's counters before and after --Accounting.book--> each sequence's stats

N tokens of the step, B sequences, R rows kept (output.py reads them), V vocabulary, bs block size.
"""

from __future__ import annotations

import torch

from moe_offload import settings
from moe_offload.control.description import ModelDescription, describe
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.model import fastpath, mla
from moe_offload.engines.offload.model.graph import ModelGraph
from moe_offload.engines.offload.runtime import kv
from moe_offload.engines.offload.runtime.accounting import Accounting, snapshot
from moe_offload.engines.offload.runtime.scheduler import SchedulerOutput
from moe_offload.errors import OffloadError
from moe_offload.log import get_logger

log = get_logger("moe_offload.runner")


def describe_model(model) -> ModelDescription:
    """The model's description (control/description.py) from its config, once per engine; a config the description
    cannot read describes as the module path, with the reason."""
    cfg = model.config
    try:
        return describe(cfg)
    except (OffloadError, ValueError, TypeError, KeyError) as e:
        return ModelDescription(str(getattr(cfg, "model_type", "")), "module", f"{type(e).__name__}: {e}", None, ())


def decode_plan(model, executor, pool, desc: ModelDescription):
    """The one place the decode path is chosen, from the description: its decode-only steps skip transformers' modules
    (model/fastpath.py: softmax, linear and MLA attention) where every layer is a kind it computes;
    None: every step runs the modules. Tests replace this function to run the module path as the reference."""
    if desc.path != "fused":
        log.info("decode steps run transformers' modules", model_type=desc.model_type, reason=desc.why)
        return None
    if executor is not None and executor.device.type != "cpu":  # the fused kernels are CPU kernels
        log.info("fused decode path off: decode steps run the owned graph", model_type=desc.model_type,
                 reason=f"the fused kernels are CPU kernels; on {executor.device.type} the graph's torch ops run, a "
                        "layer's slot hits gathered (experts/cuda.py)")
        return None
    return fastpath.DecodePlan.build(model, executor, pool, desc)


def split_for_ranks(model, executor, desc: ModelDescription) -> bool:
    """On ``--tensor-parallel`` ranks that will decode through transformers' modules (by the description, the
    executor's device and fused_bind.refuse on some rank: what is known before the KV pool exists), attention heads
    and dense MLPs split now (dense_split.split_dense), so the KV probe counts the rank's KV heads alone and the pool
    holds N times the tokens of one process's budget. True when split; every rank or none (their exchanges match)."""
    if not _ranks(executor) or desc.attention == "mla":
        return False  # MLA: its latent cache does not split; the runner decides once mla.prepare has absorbed it
    from moe_offload.engines.offload.model import fused_bind

    try:
        fused = (desc.path == "fused" and executor.device.type == "cpu"
                 and not fused_bind.refuse(model, executor, desc))
    except (AttributeError, TypeError, ValueError, RuntimeError):  # as DecodePlan.build: the module path
        fused = False
    return _split_unless(fused, model, executor)


def _ranks(executor) -> bool:
    """The executor is one rank of several (``--tensor-parallel``)."""
    return getattr(executor, "ep", None) is not None and executor.ep[1] > 1


def _split_unless(fused: bool, model, executor, **note) -> bool:
    """Attention heads and dense MLPs split (dense_split.split_dense) on every rank unless ``fused`` holds on every
    rank (parallel.agree: the ranks' exchanges must match); True when split."""
    from moe_offload.engines.offload.ranks.dense_split import split_dense
    from moe_offload.engines.offload.ranks.parallel import agree

    if agree(fused):
        return False
    log.info("dense layers split over the ranks", **note, **split_dense(model, *executor.ep))
    return True


class ModelRunner:
    """Runs a step's forward on ``model`` (with ``executor``, may be None). ``paged``: the KV lives in ``pool``'s
    blocks and a step is one forward; else each sequence keeps the model's own cache (Request.cache). ``fast``:
    the fused decode plan, or None (set it to None to run every step through transformers' modules). ``split``: the
    ranks' dense layers are split already (split_for_ranks): the modules decode."""

    def __init__(self, model, executor, pool: kv.KVPool, device: torch.device, accounting: Accounting, *, paged: bool,
                 desc: ModelDescription | None = None, split: bool = False):
        self.model, self.executor, self.pool, self.device = model, executor, pool, device
        self.desc = desc if desc is not None else describe_model(model)
        self.accounting, self.paged = accounting, paged
        self.paged_cache = kv.PagedCache(pool)
        # MLA layers decode over their latent cache with kv_b_proj absorbed (mla.py)
        self.mla_layers = mla.prepare(model) if paged else 0
        self.fast = decode_plan(model, executor, pool, self.desc) if paged and not split else None
        self.capture = None  # decode steps as captured CUDA graphs over the graph (model/capture.py; the engine sets it)
        # the last step's rows for MTP drafts (mtp.py): (ids, pos, StepContext, [(seq, first row, rows, computed)],
        # the final norm's rows [N, H]); set by the graph's steps and, when it keeps them, the fused call's
        self.last = None
        # every other paged step: the owned graph, or (None) transformers' modules
        self.graph = None
        if paged and not split and settings.get("MOE_OFFLOAD_GRAPH"):
            self.graph = ModelGraph.build(model, executor, self.desc, self.paged_cache)
        elif paged:
            log.info("owned graph off: steps run transformers' modules", reason="split ranks" if split else
                     "MOE_OFFLOAD_GRAPH=0")
        # ranks whose plan failed to bind on some rank split now (the pool is sized for whole heads)
        if not split and _ranks(executor) and _split_unless(self.fast is not None, model, executor,
                                                            kv="sized for whole heads"):
            self.fast = self.graph = None
        if self.graph is None and not split:  # the fallback runs transformers' modules: their bf16 linears' rows on
            dispatch.patch_linears(model)  # the kernels (the graph binds them instead: dispatch.bound)
        if paged:  # the paths, once: decode-only steps, and every other step (prefill chunks, mixed, verification)
            log.info("step paths", model_type=self.desc.model_type, other="graph" if self.graph else "modules",
                     decode="fused" if self.fast else ("graph" if self.graph else "modules"))

    def forward(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Logits [R, V] of the step (rows as output.py reads them), or None when no sequence has a row."""
        return self.forward_paged(out) if self.paged else self.forward_each(out)

    def forward_paged(self, out: SchedulerOutput) -> torch.Tensor | None:
        sched = out.scheduled
        plain = out.decode_only and not any(seq.payload.wants_prompt_logprobs(seq) for seq, _ in sched)
        if self.fast is not None and plain:
            return self.forward_fast(out)
        if self.capture is not None and plain and not any(seq.draft for seq, _ in sched):
            logits = self.forward_captured(out)
            if logits is not False:
                return logits
        dev = self.device
        rows, slots = _placed(sched, self.pool.block_size)
        ids, pos, keep = [], [], []
        for seq, n in sched:
            c = seq.computed
            ids += seq.window(n)
            pos += range(c, c + n)
            if seq.payload.wants_prompt_logprobs(seq) or seq.draft:
                keep += range(len(ids) - n, len(ids))  # every position: prompt logprobs, or a draft to verify
            elif c + n == len(seq.tokens):
                keep.append(len(ids) - 1)
        step = self.layout(out)
        step.slot_mapping = torch.tensor(slots, device=dev)  # [N]
        if self.executor is not None:
            self.executor.per_token = len(sched) > 1
        before = snapshot(self.executor)
        kept = torch.tensor(keep or [len(ids) - 1], device=dev)  # [R]
        if self.graph is not None:
            ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
            logits = self.graph.forward(ids_t, pos_t, step, kept)
            self.last = (ids_t, pos_t, step, rows, self.graph.hidden)
            self.accounting.book(self.executor, sched, before, getattr(self.executor, "token_stats", None))
            return logits if keep else None
        with kv.active(step):
            res = self.model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                             cache=self.paged_cache, use_cache=True, logits_to_keep=kept)
        self.accounting.book(self.executor, sched, before, getattr(self.executor, "token_stats", None))
        if not keep:
            return None
        logits = res.logits[0]
        if logits.shape[0] != len(keep):  # a model that ignores logits_to_keep (Qwen3-Omni's thinker): every position
            logits = logits.index_select(0, kept)
        return logits  # [R, V]

    def forward_fast(self, out: SchedulerOutput) -> torch.Tensor | None:
        """A decode-only step on the fused path: one row per token (a sequence's token, then its draft's, each at its
        own position over the same block table: the kernels write every row's KV before any row attends), logits
        [M, V], then the rows that sample."""
        sched, ex = out.scheduled, self.executor
        ids, lens, blocks, seats, keep = [], [], [], [], []
        for seq, n in sched:
            seat, c = self.pool.seat(seq.sid), seq.computed
            if seq.draft or c + 1 == len(seq.tokens):  # a one-token prefill chunk that does not end its prompt: none
                keep += range(len(ids), len(ids) + n)
            ids += seq.window(n)
            lens += range(c + 1, c + n + 1)
            blocks += [seq.blocks] * n
            seats += [seat] * n
        ex.per_token = len(sched) > 1
        before = snapshot(ex)
        logits = self.fast.forward(ids, lens, blocks, seats)
        self.accounting.book(ex, sched, before, ex.token_stats)
        if self.fast.keep_hidden:  # MTP drafts: the step's rows as forward_paged records them, its KV layout
            self._record(out, ids, [n - 1 for n in lens], self.fast.hidden)
        return _kept(logits, keep)

    def _record(self, out: SchedulerOutput, ids: list[int], pos: list[int], hidden: torch.Tensor) -> None:
        dev = self.device
        rows, slots = _placed(out.scheduled, self.pool.block_size)
        step = self.layout(out)
        step.slot_mapping = torch.tensor(slots, device=dev)
        self.last = (torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), step, rows, hidden)

    def forward_captured(self, out: SchedulerOutput) -> torch.Tensor | None | bool:
        """A decode-only step through the captured graph (model/capture.py): logits of the rows that sample, or False
        where the step is in no bucket (the graph runs it eagerly)."""
        sched, ex = out.scheduled, self.executor
        ids = [seq.tokens[seq.computed] for seq, _ in sched]
        lens = [seq.computed + 1 for seq, _ in sched]
        keep = [i for i, (seq, _) in enumerate(sched) if seq.computed + 1 == len(seq.tokens)]
        ex.per_token = len(sched) > 1
        before = snapshot(ex)
        logits = self.capture.forward(ids, lens, [seq.blocks for seq, _ in sched])
        if logits is None:
            return False
        self.accounting.book(ex, sched, before, ex.token_stats)
        return _kept(logits, keep)

    def layout(self, out: SchedulerOutput) -> kv.StepContext:
        """The step's key layout: decode sequences first, each padded to the longest; then each prefill chunk's
        sequence. One sequence in contiguous blocks reads its rows as a view (single-stream decode copies nothing)."""
        sched = out.scheduled
        bs, dev = self.pool.block_size, self.device
        seqs, q = [], 0
        for seq, n in sched:
            seqs.append(kv.SeqSlice(q, n, seq.computed + n, seat=self.pool.seat(seq.sid)))
            q += n
        step = kv.StepContext(None, seqs, pool=self.pool)
        decode = [i for i, (_, n) in enumerate(sched) if n == 1]
        if len(sched) == 1 and sched[0].seq.contiguous:
            seq = sched[0].seq
            step.view = (seq.blocks[0] * bs, seqs[0].ctx_len)
            if decode:
                step.decode, step.lmax = decode, seqs[0].ctx_len
                step.decode_rows = torch.tensor([0], device=dev)
            return step
        parts, k = [], 0
        if decode:
            lmax = max(seqs[i].ctx_len for i in decode)
            step.decode, step.lmax = decode, lmax
            step.decode_rows = torch.tensor([seqs[i].q_start for i in decode], device=dev)  # [Bd]
            step.decode_pos = torch.tensor([seqs[i].ctx_len - 1 for i in decode], device=dev)  # [Bd]
            step.decode_lens = lens = torch.tensor([seqs[i].ctx_len for i in decode], device=dev)
            step.decode_mask = (torch.arange(lmax, device=dev).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            for i in decode:
                r = _rows(sched[i].seq.blocks, bs, seqs[i].ctx_len, dev)
                parts.append(torch.cat([r, r[:1].expand(lmax - len(r))]) if len(r) < lmax else r)  # [lmax]
                seqs[i].k_start = k
                k += lmax
        for i, (seq, n) in enumerate(sched):
            if n != 1:
                parts.append(_rows(seq.blocks, bs, seqs[i].ctx_len, dev))
                seqs[i].k_start = k
                k += seqs[i].ctx_len
        step.gather = torch.cat(parts)  # [X] pool rows of the key layout
        return step

    def forward_each(self, out: SchedulerOutput) -> torch.Tensor | None:
        """One forward per sequence on its own cache; rows as forward_paged keeps them."""
        rows = []
        for seq, n in out.scheduled:
            req, c = seq.payload, seq.computed
            if c == 0:
                req.cache = None  # a new or preempted sequence starts a fresh cache
            before = snapshot(self.executor)
            every = req.wants_prompt_logprobs(seq)
            res = self.model(input_ids=torch.tensor([seq.tokens[c : c + n]], device=self.device),
                             position_ids=torch.arange(c, c + n, device=self.device).unsqueeze(0),
                             cache=req.cache, use_cache=True, logits_to_keep=0 if every else 1)
            req.cache = res.past_key_values
            self.accounting.book(self.executor, [(seq, n)], before, None)
            if every:
                rows.append(res.logits[0])  # [n, V]
            elif c + n == len(seq.tokens):
                rows.append(res.logits[0, -1:])  # [1, V]
        return torch.cat(rows) if rows else None


def _placed(sched, bs: int) -> tuple[list, list[int]]:
    """Each scheduled sequence's (seq, first row, rows, computed), and the pool row of each of the step's tokens."""
    rows, slots, q = [], [], 0
    for seq, n in sched:
        c, b = seq.computed, seq.blocks
        rows.append((seq, q, n, c))
        slots += [b[p // bs] * bs + p % bs for p in range(c, c + n)]
        q += n
    return rows, slots


def _kept(logits: torch.Tensor, keep: list[int]) -> torch.Tensor | None:
    """The rows of a one-row-per-token step's logits [M, V] that sample (all of them: no copy), or None."""
    if len(keep) == logits.shape[0]:
        return logits
    return logits[keep] if keep else None


def _rows(blocks: list[int], bs: int, n: int, device) -> torch.Tensor:
    """Pool rows of positions 0..n-1 of a sequence holding ``blocks``: [n]."""
    b = torch.tensor(blocks, device=device)
    return (b.unsqueeze(1) * bs + torch.arange(bs, device=device)).reshape(-1)[:n]
