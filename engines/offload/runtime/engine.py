"""OffloadEngine: continuous batching over an OffloadedModel (transformers model + offload executor).

    start(prompt) --> Scheduler.waiting --schedule()--> step: [(sequence, tokens)] packed into one forward [1, N]
      --model + paged KV (kv.py) + executor (experts grouped by expert over all N tokens)--> logits of each
      sequence whose tokens are all computed --sample per sequence--> Generation.pending, stop / length checks
    stats: the executor's counters per step, attributed per token (hits, host pairs) or shared (bytes, stage time)

Sequences join and leave at step boundaries; a step holds every running sequence's decode token plus
prefill chunks up to ``max_num_batched_tokens``. KV memory is blocks from a budget (``kv_cache_memory``),
handed out as sequences grow; when they run out the youngest sequence is preempted and recomputed later.
A model whose layers keep state other than attention KV (Mamba, linear attention) runs each sequence of a
step in its own forward with the model's own cache (``paged`` False), under the same scheduler.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_offload.control.vocab import MISS_POLICIES
from moe_offload.engines.base import ENGINE_FEATURES, Engine, EngineInfo, Generation, GenerationStats, SamplingParams
from moe_offload.engines.offload.runtime import fastpath, kv
from moe_offload.engines.offload.runtime.sampling import SequenceState, prompt_logprobs, sample
from moe_offload.engines.offload.runtime.scheduler import FINISHED, RUNNING, Scheduler, SchedulerConfig
from moe_offload.engines.offload.runtime.scheduler import Sequence as Seq
from moe_offload.errors import ConfigError, EngineError
from moe_offload.log import get_logger

POLICIES = MISS_POLICIES
BUILD_OPTIONS = ("device", "backend", "policy", "fraction", "dtype", "expert_dtype", "dense_dtype", "hybrid_threshold", "cache",
                 "block_size",
                 "kv_cache_memory", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
CACHES = ("paged", "dynamic")
DEFAULT_KV_CPU = 4 * 2**30  # bytes: the KV budget on a cpu device unless kv_cache_memory says otherwise
log = get_logger("engine.offload")


# -- executor statistics -> GenerationStats ------------------------------------------------------------------
def _snapshot(executor) -> tuple:
    """(hits, misses, host pairs, bytes copied, stage seconds) so far: cheap enough to take every step."""
    st = getattr(executor, "stats", None)
    if st is None:
        return (0, 0, 0, 0, {})
    t = st.totals()
    stage = dict(st.stage_s)
    stage["other"] = st.forward_s - sum(stage.values())
    return (t["hits"], t["misses"], t["host_tokens"], t["bytes_copied"], stage)


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    found: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in found:
                found.append(v)
    return tuple(found)


@dataclass(frozen=True)
class KVCacheConfig:
    """KV memory, in vLLM's terms. ``kv_cache_memory``: bytes for the block pool (None: 4 GiB on a cpu device,
    80 % of the free memory after loading on cuda). ``max_model_len``: longest sequence (prompt + output) served
    (None: the model's, capped to what the pool holds). ``block_size``: tokens per block."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    max_model_len: int | None = None

    def __post_init__(self):
        for name in ("block_size", "kv_cache_memory", "max_model_len"):
            v = getattr(self, name)
            if v is None and name != "block_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")


@dataclass(eq=False)
class _Request:
    """The engine's state of one sequence (Seq.payload)."""

    params: SamplingParams
    gen: Generation
    stats: GenerationStats
    stops: frozenset
    state: SequenceState  # sampling: generator, penalties' counts, grammar position
    t_start: float = 0.0  # first scheduled (perf_counter s)
    t_last: float = 0.0  # last token emitted
    cache: Any = None  # the model's own cache (per-sequence path only)

    def wants_prompt_logprobs(self, seq: Seq) -> bool:
        """This step's chunk still covers prompt positions whose logprobs are owed."""
        plps = self.gen.prompt_logprobs
        return plps is not None and len(plps) < seq.prompt_len and seq.computed < seq.prompt_len


class OffloadEngine(Engine):
    """One OffloadedModel (or any object with ``.model``, ``.device``) plus its tokenizer (may be None).

    ``cache``: "paged" (block pool, all sequences of a step in one forward) or "dynamic" (each sequence its own
    forward on the model's own cache; what stateful families get anyway)."""

    batching = True

    def __init__(self, offloaded, tokenizer=None, *, model_name: str = "", backend: str = "cpu", cache: str = "paged",
                 kv_config: KVCacheConfig | None = None, scheduler: SchedulerConfig | None = None):
        if cache not in CACHES:
            raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
        self.offloaded = offloaded
        self.model = offloaded.model
        self.tokenizer = tokenizer
        self.executor = getattr(offloaded, "executor", None)
        self.device = torch.device(getattr(offloaded, "device", None) or self.model.device)
        kv_config = kv_config or KVCacheConfig()
        sched = scheduler or SchedulerConfig()
        text_config = self.model.config.get_text_config()
        model_len = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
        want_len = min(kv_config.max_model_len or model_len, model_len)
        self.kv_bytes_per_token = self._probe() if cache == "paged" else None
        self.paged = self.kv_bytes_per_token is not None
        if cache == "paged" and not self.paged:
            log.info("model keeps per-layer state beyond attention KV: each sequence runs in its own forward",
                     model_type=self.model.config.model_type)
        self.kv_cache_memory = self._kv_budget(kv_config.kv_cache_memory)
        bs = kv_config.block_size
        blocks = -(-sched.max_num_seqs * want_len // bs)  # every seat at full length: never more is needed
        if self.paged:
            fit = self.kv_cache_memory // (self.kv_bytes_per_token * bs)
            if fit < 1:
                raise ConfigError(f"kv_cache_memory: {self.kv_cache_memory} bytes hold no block of {bs} tokens "
                                  f"({self.kv_bytes_per_token * bs} bytes); give more")
            blocks = min(fit, blocks)
        # else the model's own caches hold the state; the pool only counts tokens for admission
        self.pool = kv.KVPool(int(blocks), bs, self.device)
        max_len = min(want_len, self.pool.num_blocks * bs)
        if max_len < want_len:
            log.warning("max_model_len capped to what the KV budget holds", max_model_len=max_len, asked=want_len,
                        kv_cache_memory=self.kv_cache_memory)
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, chunked_prefill=self.paged), self.pool)
        self.paged_cache = kv.PagedCache(self.pool)
        # decode-only steps of covered bf16 CPU families skip transformers' modules (fastpath.py)
        self.fast = fastpath.DecodePlan.build(self.model, self.executor, self.pool) if self.paged else None
        placement = getattr(offloaded, "placement", None)
        self.info = EngineInfo(
            model=model_name or getattr(self.model.config, "_name_or_path", "") or "model",
            backend=backend,
            vocab_size=int(text_config.vocab_size),
            max_model_len=int(max_len),
            eos_token_ids=_eos_ids(self.model, tokenizer),
            policy=str(getattr(offloaded, "policy", "") or ""),
            predicted_hit_rate=dict(getattr(placement, "predicted_hit_rate", {}) or {}),
            features=frozenset(ENGINE_FEATURES),
        )
        self._llg = None  # llguidance's tokenizer, built at the first structured-output request
        self._total = GenerationStats()
        self._next_sid = 0
        self._steps = 0
        self._closed = False

    # -- set-up ---------------------------------------------------------------------------------------------
    def _probe(self) -> int | None:
        """KV bytes per token of the paged path, or None when a layer needs more than ``cache.update``."""
        kv.register()
        old = kv.set_attention(self.model, kv.ATTENTION)
        cache = kv.PagedCache(None)
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        pos = torch.arange(2, device=self.device).unsqueeze(0)
        if self.executor is not None:
            self.executor.dry = True
        try:
            with torch.inference_mode(), kv.active(kv.StepContext(slot_mapping=None, seqs=[], probe=True)):
                self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        except Exception as e:  # noqa: BLE001 - any failure means: not this path
            log.debug("paged KV probe failed", error=f"{type(e).__name__}: {e}")
            cache.seen.clear()
        finally:
            if self.executor is not None:
                self.executor.dry = False
        layers = int(getattr(self.model.config.get_text_config(), "num_hidden_layers", 0) or 0)
        if self.executor is not None and getattr(self.executor, "stats", None) is not None:
            self.executor.stats.reset()  # the probe is not a request
        if not cache.seen or len(cache.seen) != layers:
            kv.set_attention(self.model, old)
            return None
        total = 0
        for kshape, vshape, dtype in cache.seen.values():  # [1, Hkv, 2, D]
            total += (kshape[1] * kshape[3] + vshape[1] * vshape[3]) * torch.empty((), dtype=dtype).element_size()
        return total

    def _kv_budget(self, asked: int | None) -> int:
        if asked is not None:
            return asked
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return DEFAULT_KV_CPU

    # -- the contract ---------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self.start(prompt_ids, params)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise ConfigError("engine is closed")
        prompt = list(prompt_ids)
        self.check_prompt(prompt, params)
        state = SequenceState(params, prompt, vocab_size=self.info.vocab_size, device=self.device,
                              eos_ids=self.info.eos_token_ids, matcher=self._matcher(params))
        stops = frozenset(state.stop_ids)  # stop_token_ids, and EOS unless ignore_eos
        stats = GenerationStats(prompt_tokens=len(prompt))
        seq = Seq(self._next_sid, prompt, len(prompt), len(prompt) + params.max_tokens)
        self._next_sid += 1
        gen = Generation(None, stats, [] if params.logprobs is not None else None,
                         [] if params.prompt_logprobs is not None else None,
                         drive=self._drive, on_close=lambda: self._finish(seq, "abort"))
        seq.payload = _Request(params, gen, stats, stops, state)
        self.scheduler.add(seq)
        return gen

    def _matcher(self, params: SamplingParams):
        if params.structured is None:
            return None
        from moe_offload.engines import grammar

        if self.tokenizer is None:
            raise ConfigError("structured output: this checkpoint has no tokenizer to compile the constraint against")
        if self._llg is None:
            self._llg = grammar.llg_tokenizer(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids)
        return grammar.Matcher(params.structured, self._llg)

    def _drive(self) -> None:
        if not self.step():
            raise EngineError("the engine has no work left but a generation is still waiting for tokens")

    def load(self) -> dict[str, Any]:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_usage": self.pool.usage}

    def cache_info(self) -> dict[str, Any]:
        """What vllm:cache_config_info reports."""
        return {"block_size": self.pool.block_size, "num_gpu_blocks": self.pool.num_blocks,
                "cache_dtype": "auto", "kv_cache_memory_bytes": self.kv_cache_memory if self.paged else 0,
                "paged": self.paged, "max_num_seqs": self.scheduler.config.max_num_seqs,
                "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
                "max_model_len": self.info.max_model_len}

    def stats(self) -> dict[str, Any]:
        d = self._total.to_dict()
        d["preemptions"] = self.scheduler.preemptions
        d["steps"] = self._steps
        return d

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            seq.payload.gen.done = True
            self.scheduler.finish(seq)
        self.pool.close()
        close = getattr(self.executor, "close", None) or getattr(self.offloaded, "close", None)
        if close:
            close()
        self.model = self.offloaded = self.executor = self.fast = None  # the plan holds the model's weights too
        gc.collect()

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one forward over the scheduled tokens of every running sequence; False when there is nothing to do."""
        if self._closed:
            return False
        sched = self.scheduler.schedule()
        if not sched:
            return False
        self._steps += 1
        t0 = time.perf_counter()
        for seq, _ in sched:
            if not seq.payload.t_start:
                seq.payload.t_start = t0
        try:
            with torch.inference_mode():
                if self.paged:
                    logits = self._forward_paged(sched)
                else:
                    logits = self._forward_each(sched)
                self._emit(sched, logits)
        except RuntimeError as e:  # torch failures (out of memory, a kernel error): these requests fail, not the server
            for seq, _ in sched:
                if seq.state == RUNNING:
                    req = seq.payload
                    req.gen.error = EngineError(f"generation failed after {req.stats.completion_tokens} tokens: {e}")
                    self._finish(seq, req.stats.finish_reason)
        return True

    def _forward_paged(self, sched) -> torch.Tensor | None:
        if self.fast is not None and all(n == 1 for _, n in sched) and not any(
                seq.payload.wants_prompt_logprobs(seq) for seq, _ in sched):
            return self._forward_fast(sched)
        bs, dev = self.pool.block_size, self.device
        ids, pos, slots, keep = [], [], [], []
        for seq, n in sched:
            c = seq.computed
            ids += seq.tokens[c : c + n]
            pos += range(c, c + n)
            b = seq.blocks
            slots += [b[p // bs] * bs + p % bs for p in range(c, c + n)]
            if seq.payload.wants_prompt_logprobs(seq):
                keep += range(len(ids) - n, len(ids))  # every position: prompt logprobs
            elif c + n == len(seq.tokens):
                keep.append(len(ids) - 1)
        step = self._layout(sched)
        step.slot_mapping = torch.tensor(slots, device=dev)
        if self.executor is not None:
            self.executor.per_token = len(sched) > 1
        before = _snapshot(self.executor)
        kept = torch.tensor(keep or [len(ids) - 1], device=dev)
        with kv.active(step):
            out = self.model(input_ids=torch.tensor([ids], device=dev), position_ids=torch.tensor([pos], device=dev),
                             cache=self.paged_cache, use_cache=True, logits_to_keep=kept)
        self._book(sched, before, getattr(self.executor, "token_stats", None))
        if not keep:
            return None
        logits = out.logits[0]
        if logits.shape[0] != len(keep):  # a model that ignores logits_to_keep (Qwen3-Omni's thinker): every position
            logits = logits.index_select(0, kept)
        return logits  # [rows kept, V]: see _emit

    def _forward_fast(self, sched) -> torch.Tensor:
        """A decode-only step on the fused path: one token per sequence, logits [B, V] (every row samples)."""
        ex = self.executor
        ex.per_token = len(sched) > 1
        before = _snapshot(ex)
        logits = self.fast.forward([seq.tokens[seq.computed] for seq, _ in sched],
                                   [seq.computed + 1 for seq, _ in sched], [seq.blocks for seq, _ in sched])
        self._book(sched, before, ex.token_stats)
        # rows for the sequences that sample (as _forward_paged keeps them): a one-token prefill chunk that does not
        # end its prompt has none
        keep = [i for i, (seq, _) in enumerate(sched) if seq.computed + 1 == len(seq.tokens)]
        if len(keep) == len(sched):
            return logits
        return logits[keep] if keep else None

    def _layout(self, sched) -> kv.StepContext:
        """The step's key layout: decode sequences first, each padded to the longest; then each prefill chunk's
        sequence. One sequence in contiguous blocks reads its rows as a view (single-stream decode copies nothing)."""
        bs, dev = self.pool.block_size, self.device
        seqs, q = [], 0
        for seq, n in sched:
            seqs.append(kv.SeqSlice(q, n, seq.computed + n))
            q += n
        step = kv.StepContext(None, seqs, pool=self.pool)
        decode = [i for i, (_, n) in enumerate(sched) if n == 1]
        if len(sched) == 1 and sched[0][0].contiguous:
            seq = sched[0][0]
            step.view = (seq.blocks[0] * bs, seqs[0].ctx_len)
            if decode:
                step.decode, step.lmax = decode, seqs[0].ctx_len
                step.decode_rows = torch.tensor([0], device=dev)
            return step
        parts, k = [], 0
        if decode:
            lmax = max(seqs[i].ctx_len for i in decode)
            step.decode, step.lmax = decode, lmax
            step.decode_rows = torch.tensor([seqs[i].q_start for i in decode], device=dev)
            step.decode_pos = torch.tensor([seqs[i].ctx_len - 1 for i in decode], device=dev)
            lens = torch.tensor([seqs[i].ctx_len for i in decode], device=dev)
            step.decode_mask = (torch.arange(lmax, device=dev).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            for i in decode:
                r = _rows(sched[i][0].blocks, bs, seqs[i].ctx_len, dev)
                parts.append(torch.cat([r, r[:1].expand(lmax - len(r))]) if len(r) < lmax else r)
                seqs[i].k_start = k
                k += lmax
        for i, (seq, n) in enumerate(sched):
            if n != 1:
                parts.append(_rows(seq.blocks, bs, seqs[i].ctx_len, dev))
                seqs[i].k_start = k
                k += seqs[i].ctx_len
        step.gather = torch.cat(parts)
        return step

    def _forward_each(self, sched) -> torch.Tensor | None:
        rows = []
        for seq, n in sched:
            req, c = seq.payload, seq.computed
            if c == 0:
                req.cache = None  # a new or preempted sequence starts a fresh cache
            before = _snapshot(self.executor)
            every = req.wants_prompt_logprobs(seq)
            out = self.model(input_ids=torch.tensor([seq.tokens[c : c + n]], device=self.device),
                             position_ids=torch.arange(c, c + n, device=self.device).unsqueeze(0),
                             cache=req.cache, use_cache=True, logits_to_keep=0 if every else 1)
            req.cache = out.past_key_values
            self._book([(seq, n)], before, None)
            if every:
                rows.append(out.logits[0])
            elif c + n == len(seq.tokens):
                rows.append(out.logits[0, -1:])
        return torch.cat(rows) if rows else None

    def _emit(self, sched, logits) -> None:
        """Prompt logprobs of prefill chunks, then one sampled token per sequence whose tokens are all computed.
        ``logits`` rows: per scheduled sequence, every chunk position (prompt logprobs owed) or the last (it samples)."""
        now = time.perf_counter()
        sampled, rows, r = [], [], 0
        for seq, n in sched:
            req = seq.payload
            samples = seq.computed + n == len(seq.tokens)
            if req.wants_prompt_logprobs(seq):
                c = seq.computed
                entries = prompt_logprobs(logits[r : r + n], seq.tokens[c : c + n + 1], req.params.prompt_logprobs)
                req.gen.prompt_logprobs.extend(entries if c == 0 else entries[1:])  # entry 0: the chunk's first token
                r += n
                if samples:
                    rows.append(r - 1)
            elif samples:
                rows.append(r)
                r += 1
            if samples:
                sampled.append(seq)
        for seq, n in sched:
            seq.computed += n
        if not sampled:
            return
        picks = sample(logits[rows] if len(rows) != logits.shape[0] else logits, [s.payload.state for s in sampled])
        for seq, (token, entry) in zip(sampled, picks):
            req = seq.payload
            st = req.stats
            st.record_step(0 if req.t_last == 0.0 else 1, req.t_start, req.t_last, now)  # first token ends the prefill
            req.t_last = now
            if token in req.stops:
                self._finish(seq, "stop")
                continue
            req.state.accept(token)
            st.completion_tokens += 1
            seq.tokens.append(token)
            if req.gen.logprobs is not None:
                req.gen.logprobs.append(entry)
            req.gen.pending.append(token)
            if req.state.finished:  # a structured output is complete: nothing but EOS could follow
                self._finish(seq, "stop")
            elif st.completion_tokens >= req.params.max_tokens:
                self._finish(seq, "length")

    def _finish(self, seq: Seq, reason: str) -> None:
        if seq.state == FINISHED:
            return
        req = seq.payload
        self.scheduler.finish(seq)
        req.cache = None
        req.stats.finish_reason = reason
        req.gen.done = True
        self._finalise(req.stats)

    # -- statistics -----------------------------------------------------------------------------------------
    def _book(self, sched, before: tuple, token_stats) -> None:
        """Attribute one forward's executor counters to its sequences: hit and host pairs per token where the
        forward held several sequences; copied bytes and stage times shared equally (they serve the whole step)."""
        if self.executor is None:
            return
        after = _snapshot(self.executor)
        hits, misses, host, copied = (after[i] - before[i] for i in range(4))
        stage = {k: v - before[4].get(k, 0.0) for k, v in after[4].items()}
        acc = self.executor.tier_names[0]
        n_seq, n_tok = len(sched), sum(n for _, n in sched)
        q = 0
        for i, (seq, n) in enumerate(sched):
            st = seq.payload.stats
            if n_seq == 1:
                h, m, ho = hits, misses, host
            else:
                rows = token_stats[q : q + n].sum(dim=0).tolist() if token_stats is not None else (0, 0)
                h, ho = int(rows[0]), int(rows[1])
                m = (hits + misses) * n // n_tok - h  # every token routes the same number of pairs
            q += n
            st.hits += h
            st.misses += m
            st.host_expert_tokens += ho
            st.bytes_moved[acc] = st.bytes_moved.get(acc, 0) + copied // n_seq + (copied % n_seq if i == 0 else 0)
            for k, v in stage.items():
                st.stage_ms[k] = st.stage_ms.get(k, 0.0) + v * 1000 / n_seq

    def _finalise(self, s: GenerationStats) -> None:
        """A finished request's per-tier rates, then its sum into the engine's totals (and theirs)."""
        self._tier_rates(s)
        if self.executor is not None:
            s.bytes_moved.setdefault(self.executor.tier_names[0], 0)
        self._total.add(s)
        self._tier_rates(self._total)

    def _tier_rates(self, s: GenerationStats) -> None:
        """Routed pairs served per tier: hits from the accelerator's slots, misses from the host tier."""
        if self.executor is not None:
            acc, host = self.executor.tier_names
            routed = s.hits + s.misses
            s.hit_rate_by_tier = {acc: s.hits / routed if routed else 0.0, host: s.misses / routed if routed else 0.0}


def _rows(blocks: list[int], bs: int, n: int, device) -> torch.Tensor:
    """Pool rows of positions 0..n-1 of a sequence holding ``blocks``: [n]."""
    b = torch.tensor(blocks, device=device)
    return (b.unsqueeze(1) * bs + torch.arange(bs, device=device)).reshape(-1)[:n]


# -- building -----------------------------------------------------------------------------------------------
def _resolve_placement(path: Path, placement, fraction, policy: str, backend: str, dtype: str | None = None):
    from rm_core import Placement

    if placement is not None and fraction is not None:
        raise ConfigError("give either a placement or a fraction, not both")
    if isinstance(placement, Placement):
        return placement
    if isinstance(placement, (str, os.PathLike)):
        file = Path(placement).expanduser()
        if not file.is_file():
            raise ConfigError(f"placement: expected a placement JSON file, got {str(file)!r} (not found)")
        try:
            return Placement.from_json(file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"placement {file}: not a valid placement JSON ({e})") from None
    if placement is not None:
        raise ConfigError(f"placement: expected an rm_core.Placement or a JSON file path, got {type(placement).__name__}")
    fraction = 1.0 if fraction is None else fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"fraction: expected a number in 0..1, got {fraction!r}")
    from moe_offload.backends import get_backend
    from moe_offload.control import placement as plan
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.loading.loader import inspect_checkpoint

    # The MoE layers are those whose experts modules the model builds (what load_model will offload).
    experts = inspect_checkpoint(path, dtype)[1]
    spec = dataclasses.replace(ModelSpec.from_hf_config(str(path)), moe_layers=tuple(i.layer for i in experts),
                               num_experts=experts[0].num_experts)
    slots = plan.fraction_slots(spec, float(fraction))
    return plan.from_fraction(spec, get_backend(backend).tiers(), float(fraction), plan.for_miss_policy(policy, slots, spec.num_experts))


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when the directory has none (the engine then works on ids only)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_offload_engine(
    model_path=None,
    placement=None,
    *,
    device: str = "cpu",
    backend: str = "cpu",
    policy: str = "static",
    fraction: float | None = None,
    dtype: str | None = None,
    hybrid_threshold: int | None = None,
    cache: str = "paged",
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    expert_dtype: str | None = None,
    dense_dtype: str | None = None,
    **unknown,
) -> OffloadEngine:
    """Load ``model_path`` (default: the demo model, built on first use) with the offload executor.

    placement: an rm_core.Placement, a placement JSON path, or None (then ``fraction`` 0..1 of each layer's
    experts get accelerator slots, default 1.0). policy: static | lru | hybrid. dtype: "bfloat16" |
    "float32" | "float16" | None (the checkpoint's). hybrid_threshold: tokens per expert and step from
    which hybrid fetches. cache: "paged" (block pool, batched steps) or "dynamic" (per sequence, the model's own
    cache). block_size, kv_cache_memory (bytes), max_model_len, max_num_seqs, max_num_batched_tokens: the KV
    budget and the scheduler, as vLLM names them (KVCacheConfig, SchedulerConfig). expert_dtype: "int8" | "fp8" | "bf16" | None
    (experts as the checkpoint stores them; see loader.load_model). dense_dtype: "int8" | "bf16" | None (attention
    projections and LM head; see loader.load_model).
    """
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(sorted(unknown))}; valid: {', '.join(BUILD_OPTIONS)}")
    if policy not in POLICIES:
        raise ConfigError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if cache not in CACHES:
        raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
    kv_config = KVCacheConfig(block_size, kv_cache_memory, max_model_len)  # validated before the model loads
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    from moe_offload.engines.offload.loading.loader import check_checkpoint, load_model

    if model_path is None:
        from moe_offload.demo import ensure_demo_model

        model_path = ensure_demo_model()
    path = check_checkpoint(str(Path(model_path).expanduser()))
    resolved = _resolve_placement(path, placement, fraction, policy, backend, dtype)
    offloaded = load_model(
        str(path), resolved, policy=policy, device=device, dtype=dtype, hybrid_threshold=hybrid_threshold,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype,
    )
    return OffloadEngine(offloaded, load_tokenizer(path), model_name=str(path), backend=backend, cache=cache,
                         kv_config=kv_config, scheduler=sched)


__all__ = ["KVCacheConfig", "OffloadEngine", "build_offload_engine", "load_tokenizer"]
