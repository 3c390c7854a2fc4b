"""OffloadEngine: continuous batching over an OffloadedModel (transformers model + offload executor).

    start(prompt) --> Scheduler.waiting --schedule()--> SchedulerOutput [(sequence, tokens)]
      --ModelRunner.forward (model_runner.py: one forward [1, N] over paged KV, the fused decode path, or one
        forward per sequence) + executor (experts grouped by expert over all N tokens)--> logits of each sequence
        whose tokens are all computed
      --OutputProcessor.emit (output.py: sample per sequence, stop / length checks)--> Generation.pending
    stats: the executor's counters per forward, attributed per token or shared (accounting.py); summed at finish

Sequences join and leave at step boundaries; a step holds every running sequence's decode token plus
prefill chunks up to ``max_num_batched_tokens``. With a speculative config (speculative.py) each decoding sequence carries a draft of k tokens into the step, which
verifies them in the same forward. KV memory is blocks from a budget (``kv_cache_memory``,
kv_budget.py), handed out as sequences grow; when they run out the youngest sequence is preempted and
recomputed later. A model whose layers keep state other than attention KV (Mamba, linear attention) runs
each sequence of a step in its own forward with the model's own cache (``paged`` False), under the same
scheduler. Building from a checkpoint: build.py.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from moe_offload.engines.base import Engine, EngineInfo, Generation, GenerationStats
from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.model import deltanet, mtp
from moe_offload.engines.offload.model.capture import DecodeCapture
from moe_offload.engines.offload.runtime import kv_budget
from moe_offload.engines.offload.runtime.accounting import Accounting
from moe_offload.engines.offload.runtime.kv_budget import KVCacheConfig
from moe_offload.engines.offload.runtime.model_runner import ModelRunner, describe_model, split_for_ranks
from moe_offload.engines.offload.runtime.output import OutputProcessor, Request
from moe_offload.engines.offload.runtime.prefix_cache import CacheEvent, PrefixCache
from moe_offload.engines.offload.runtime.sampling import SequenceState
from moe_offload.engines.offload.runtime.scheduler import RUNNING, Scheduler, SchedulerConfig
from moe_offload.engines.offload.runtime.scheduler import Sequence as Seq
from moe_offload.engines.offload.runtime.speculative import SpeculativeConfig, make_proposer, speculates
from moe_offload.engines.params import ENGINE_FEATURES, SamplingParams
from moe_offload.errors import ConfigError, EngineError, ModelError
from moe_offload.log import get_logger

CACHES = ("paged", "dynamic")
log = get_logger("engine.offload")


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    found: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in found:
                found.append(v)
    return tuple(found)


def _smallest_over_ranks(n: int) -> int:
    import torch.distributed as dist

    from moe_offload.engines.offload.ranks.parallel import cpu_group

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
    return int(t)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc/PID/stat); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def seeded(params):
    """``params`` with a seed when it samples without one (every rank must draw the same tokens)."""
    if params.temperature and params.temperature > 0 and params.seed is None:
        return dataclasses.replace(params, seed=random.getrandbits(63))
    return params


def approximate_label(executor, kv_cache_dtype: str = "auto") -> str:
    """The engine's opt-in approximate modes as one label ("cold_dtype=int8,tail_skip=3"), "" when exact."""
    parts = [f"cold_dtype={executor.cold_dtype}"] if getattr(executor, "cold_dtype", None) else []
    if getattr(executor, "tail_skip", None):
        parts.append(f"tail_skip={executor.tail_skip}")
    if kv_cache_dtype != "auto":
        parts.append(f"kv_cache_dtype={kv_cache_dtype}")
    return ",".join(parts)


class OffloadEngine(Engine):
    """One OffloadedModel (or any object with ``.model``, ``.device``) plus its tokenizer (may be None).

    ``cache``: "paged" (block pool, all sequences of a step in one forward) or "dynamic" (each sequence its own
    forward on the model's own cache; what stateful families get anyway)."""

    batching = True

    def __init__(self, offloaded, tokenizer=None, *, model_name: str = "", backend: str = "cpu", cache: str = "paged",
                 kv_config: KVCacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 speculative: SpeculativeConfig | None = None, prefix_caching: bool = False, kv_events: bool = False):
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
        # what each layer computes, from the config and the family registry (control/description.py), once
        self.description = describe_model(self.model)
        # gated-DeltaNet layers: their state in the pool's seats, one-token steps in one kernel call (model/deltanet.py)
        self.deltanet_layers = deltanet.install(self.model, self.description.linear)
        # ranks that decode through the modules split their heads and dense MLPs first: the probe counts theirs
        split = split_for_ranks(self.model, self.executor, self.description)
        probed = kv_budget.probe_kv_bytes(self.model, self.executor, self.device, kv_config.codes) if cache == "paged" else None
        # bytes of KV per token, and of fixed-size per-sequence state (linear attention) per sequence
        self.kv_bytes_per_token, self.state_bytes_per_seq = probed if probed is not None else (None, 0)
        self.paged = self.kv_bytes_per_token is not None
        mtp_weights = mtp.weights_for(speculative, offloaded)
        if mtp_weights is not None and self.paged:  # its KV rows in the pool too: one layer more
            self.kv_bytes_per_token += mtp.kv_bytes(self.kv_bytes_per_token, self.description)
        if cache == "paged" and not self.paged:
            log.info("model keeps per-layer state beyond attention KV: each sequence runs in its own forward",
                     model_type=self.model.config.model_type)
        # a quantized cache only where the pool holds the KV (the model's own caches keep the model dtype)
        self.kv_cache_dtype = kv_config.cache_dtype if self.paged else "auto"
        if kv_config.cache_dtype != self.kv_cache_dtype:
            log.warning("kv_cache_dtype ignored: this model's layers keep their KV in their own caches",
                        kv_cache_dtype=kv_config.cache_dtype, model_type=self.model.config.model_type)
            kv_config = dataclasses.replace(kv_config, cache_dtype="auto")
        self.kv_cache_memory = kv_budget.budget_bytes(kv_config.kv_cache_memory, self.device)
        if getattr(self.executor, "ep", None) is not None:  # expert parallel: one pool size on every rank (lockstep)
            self.kv_cache_memory = _smallest_over_ranks(self.kv_cache_memory)
        self.pool, max_len = kv_budget.make_pool(kv_config, budget=self.kv_cache_memory,
                                                 bytes_per_token=self.kv_bytes_per_token,
                                                 max_num_seqs=sched.max_num_seqs, model_len=model_len,
                                                 device=self.device, state_bytes=self.state_bytes_per_seq)
        self.prefix_caching_off = self._prefix_cache(prefix_caching, kv_events, model_name)
        self.scheduler = Scheduler(
            SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, chunked_prefill=self.paged), self.pool)
        self.accounting = Accounting(getattr(self.executor, "tier_names", None))
        self.runner = ModelRunner(self.model, self.executor, self.pool, self.device, self.accounting, paged=self.paged,
                                  desc=self.description, split=split)
        if self.paged and self.device.type == "cuda":  # decode steps as captured CUDA graphs over the owned graph
            self.runner.capture = DecodeCapture.build(self.runner, sched.max_num_seqs, int(max_len))
        self.output = OutputProcessor(self.scheduler, self.accounting)
        self.speculative, self.proposer, self.mtp = speculative, None, None
        if speculative is not None:
            if not self.paged or self.state_bytes_per_seq:
                raise ConfigError(f"speculative decoding: {self.model.config.model_type} keeps per-sequence state beyond "
                                  "attention KV (linear attention or Mamba layers), which a rejected draft cannot be "
                                  "rolled out of; run it without --speculative-config")
            self.mtp = mtp.attach(self.runner, mtp_weights, self.description) if mtp_weights is not None else None
            self.proposer = self.mtp or make_proposer(speculative, int(text_config.vocab_size))
            self.output.released = self.proposer.release
            log.info("speculative decoding on", **speculative.to_dict())
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
            approximate=approximate_label(self.executor, self.kv_cache_dtype),
        )
        self.memory_plan: dict[str, Any] | None = None  # the host memory split (hostmem.HostPlan.split; build.py)
        self._llg = None  # llguidance's tokenizer, built at the first structured-output request
        self.next_sid = 0  # the next sequence's id (the ranks of expert parallel number theirs alike)
        self._steps = 0
        self._closed = False
        self.ranks = None  # expert parallel's rank 0 (parallel.Leader): each call is replayed on the other ranks

    def _prefix_cache(self, on: bool, events: bool, model_name: str) -> str | None:
        """Prefix caching on the pool (prefix_cache.py) when asked and the layers allow it; else why not (None: on,
        or not asked)."""
        if not on:
            return None
        if not self.paged or self.state_bytes_per_seq:
            reason = ("its layers keep a per-sequence state beyond attention KV (linear attention, Mamba), which is "
                      "not saved at block boundaries")
            log.warning("prefix caching off for this model", reason=reason, model_type=self.model.config.model_type)
            return reason
        seed = f"{model_name or getattr(self.model.config, '_name_or_path', '')}|{self.model.dtype}|{self.kv_cache_dtype}"
        self.pool.cache = PrefixCache(self.pool.block_size, seed, events=events)
        if events:  # subscribers drop what they knew of this worker's blocks: a new engine starts empty
            self.pool.cache.events.append(CacheEvent("AllBlocksCleared"))
        return None

    def drain_kv_events(self) -> tuple[float, list]:
        """The prefix cache's KV events since the last call (wall-clock time, events); none when caching is off."""
        if self.pool.cache is None:
            return time.time(), []
        return self.pool.cache.drain_events()

    @property
    def prefix_caching(self) -> bool:
        return self.pool.cache is not None

    # -- the contract ---------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self.start(prompt_ids, params)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self.ranks is None:
            return self._start(prompt_ids, params)
        with self.ranks.lock:  # added here and on every rank in the same order
            params = seeded(params)
            gen = self._start(prompt_ids, params)
            self.ranks.send(("start", list(prompt_ids), params))
            return gen

    def _start(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise ConfigError("engine is closed")
        prompt = list(prompt_ids)
        self.check_prompt(prompt, params)
        state = SequenceState(params, prompt, vocab_size=self.info.vocab_size, device=self.device,
                              eos_ids=self.info.eos_token_ids, matcher=self._matcher(params))
        stops = frozenset(state.stop_ids)  # stop_token_ids, and EOS unless ignore_eos
        stats = GenerationStats(prompt_tokens=len(prompt))
        seq = Seq(self.next_sid, prompt, len(prompt), len(prompt) + params.max_tokens,
                  cacheable=params.prompt_logprobs is None, salt=params.cache_salt)
        self.next_sid += 1
        gen = Generation(None, stats, [] if params.logprobs is not None else None,
                         [] if params.prompt_logprobs is not None else None,
                         drive=self._drive, on_close=lambda: self._abort(seq))
        seq.payload = Request(params, gen, stats, stops, state)
        self.scheduler.add(seq)
        return gen

    def _abort(self, seq) -> None:
        if self.ranks is None:
            return self.output.finish(seq, "abort")
        with self.ranks.lock:  # the ranks abort it before their next step
            self.output.finish(seq, "abort")
            self.ranks.aborted.append(seq.sid)

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
                "cache_dtype": self.kv_cache_dtype, "enable_prefix_caching": self.prefix_caching,
                "prefix_caching_off": self.prefix_caching_off, "kv_cache_memory_bytes": self.kv_cache_memory if self.paged else 0,
                "paged": self.paged, "max_num_seqs": self.scheduler.config.max_num_seqs,
                "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
                "max_model_len": self.info.max_model_len, "memory_plan": self.memory_plan,
                "kernels": jit.info() if self.device.type == "cpu" else None}

    def stats(self) -> dict[str, Any]:
        d = self.accounting.total.to_dict()
        d["preemptions"] = self.scheduler.preemptions
        d["steps"] = self._steps
        if self.pool.cache is not None:
            d["prefix_cache"] = {"queries": self.pool.cache.queries, "hits": self.pool.cache.hits}
        if self.speculative is not None:
            d["speculative"] = self.speculative.to_dict() | self.accounting.total.spec_summary()
        if self.info.approximate:
            d["approximate"] = {"mode": self.info.approximate, "skipped_pairs": getattr(self.executor, "skipped", 0)}
        if self.ranks is not None and not self._closed:  # expert parallel: each rank's own experts' numbers
            d["ranks"] = self.ranks.rank_stats(self.executor.stats.snapshot())
        return d

    def health(self) -> str | None:
        """A --tensor-parallel rank that exited or was stopped (SIGSTOP: the others would wait on it in every
        collective), or an expert store whose reads fail one after another (a bad disk, a corrupt file:
        diskstore.StoreFile.health)."""
        if self._closed:
            return None
        store = getattr(getattr(self, "executor", None), "store_file", None)
        why = store.health() if store is not None else None
        if why:
            return why
        ranks = self.ranks
        if ranks is None:
            return None
        for r, p in enumerate(ranks.procs, 1):
            if p.poll() is not None:
                return f"tensor-parallel rank {r} exited (code {p.poll()})"
            if _stopped(p.pid):
                return f"tensor-parallel rank {r} is stopped (pid {p.pid}: SIGSTOP or a debugger)"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.ranks is not None:
            self.ranks.close()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            seq.payload.gen.done = True
            self.scheduler.finish(seq)
        self.pool.close()
        close = getattr(self.executor, "close", None) or getattr(self.offloaded, "close", None)
        if close:
            close()
        self.model = self.offloaded = self.executor = self.runner = None  # the runner's fused plan holds weights too
        gc.collect()

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one forward over the scheduled tokens of every running sequence; False when there is nothing to do."""
        if self._closed:
            return False
        if self.ranks is not None:
            with self.ranks.lock:  # every rank runs this step, after the aborts since the last
                self.ranks.send(("step", self.ranks.aborted[:]))
                self.ranks.aborted.clear()
                return self._step()
        return self._step()

    def _step(self) -> bool:
        if self.proposer is not None:
            self._draft()
        out = self.scheduler.schedule()
        if out.is_empty:
            return False
        self._steps += 1
        t0 = time.perf_counter()
        for seq, _ in out.scheduled:
            if not seq.payload.t_start:
                seq.payload.t_start = t0
                seq.payload.stats.cached_tokens = seq.cached_tokens or 0
        try:
            with torch.inference_mode():
                self.runner.last = None
                logits = self.runner.forward(out)
                self.scheduler.commit(out)
                self.output.emit(out, logits)
                if self.mtp is not None and self.runner.last is not None:
                    self.mtp.after(self.runner.last)  # the next step's drafts, once this step's tokens are known
        except (RuntimeError, ModelError) as e:  # torch failures (out of memory, a kernel error), an expert store that
            # vanished or was cut short under the disk tier: these requests fail, not the server
            if self.ranks is not None:
                # over --tensor-parallel ranks a failed step leaves them apart (a rank gone, a collective broken):
                # the engine itself is broken, and the worker rebuilds it
                raise
            for seq, _ in out.scheduled:
                if seq.state == RUNNING:
                    req = seq.payload
                    req.gen.error = EngineError(f"generation failed after {req.stats.completion_tokens} tokens: {e}")
                    self.output.finish(seq, req.stats.finish_reason)
        return True

    def _draft(self) -> None:
        """Draft tokens (speculative.py) for each decoding sequence that may have them, at most what its max_tokens
        leaves after the token the verify step adds; none while disable_by_batch_size sequences or more decode."""
        k, cap = self.speculative.num_speculative_tokens, self.speculative.disable_by_batch_size
        if cap is not None and sum(s.remaining == 1 for s in self.scheduler.running) >= cap:
            return
        for seq in self.scheduler.running:
            req = seq.payload
            room = min(k, req.params.max_tokens - req.stats.completion_tokens - 1)
            if seq.remaining == 1 and room > 0 and speculates(req.state):
                seq.draft = self.proposer.propose(seq.sid, seq.tokens, room)[:room]


__all__ = ["CACHES", "OffloadEngine"]
