"""The in-process engine contract every backend implements. Pure Python: no torch here.

    prompt ids --Engine.generate(params)--> Generation: iterate token ids ... then .stats

A ``Generation`` yields token ids one at a time; when it is exhausted (or
closed early: a cancelled request) its ``stats`` hold the measured numbers of
that request. ``Engine.stats()`` gives the cumulative numbers since start.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A backend implements the contract with the request's types too; they live in params.py, one import serves both.
from moe_offload.engines.params import ENGINE_FEATURES, FINISH_REASONS, SamplingParams, StructuredOutput
from moe_offload.errors import ConfigError


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (natural log, fp32 log_softmax of the model's logits before any
    penalty, bias, mask or temperature: vLLM's default "raw" logprobs). ``rank``: 1 + the number of tokens
    more likely than ``token``; ``top``: the N most likely (token id, logprob), most likely first."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def disk_rates(d: Mapping[str, float]) -> dict[str, float]:
    """The disk tier's ratios from its counters (hostcache.COUNTERS): ``host_hit_rate`` (experts asked of host memory
    that were there), ``prefetch_precision`` (guesses the router then chose) and ``prefetch_recall`` (its choices
    guessed); 0.0 where nothing was counted."""
    asked = d.get("host_hits", 0) + d.get("demand_reads", 0)
    return {"host_hit_rate": d.get("host_hits", 0) / asked if asked else 0.0,
            "prefetch_precision": d["predicted_used"] / d["predicted"] if d.get("predicted") else 0.0,
            "prefetch_recall": d["predicted_used"] / d["routed_experts"] if d.get("routed_experts") else 0.0}


@dataclass
class GenerationStats:
    """Measured numbers of one request. Times in ms; hit rates are fractions 0..1 of routed
    token-expert pairs served per tier; bytes_moved is host->accelerator copy volume per tier."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (OpenAI's prompt_tokens_details)
    completion_tokens: int = 0
    finish_reason: str = "length"
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    token_ms: list[float] = field(default_factory=list)  # wall time of each decode step after the first token
    hits: int = 0
    misses: int = 0
    hit_rate_by_tier: dict[str, float] = field(default_factory=dict)
    tier_hits: dict[str, int] = field(default_factory=dict)  # several accelerators: hit pairs per accelerator tier
    bytes_moved: dict[str, int] = field(default_factory=dict)
    host_expert_tokens: int = 0
    stage_ms: dict[str, float] = field(default_factory=dict)
    # the disk tier (experts on disk, host memory caching them): DISK_COUNTERS, this request's share; empty without one
    disk: dict[str, float] = field(default_factory=dict)
    token_ms_dropped: int = field(default=0, repr=False)  # cumulative stats: step times no longer in token_ms
    # speculative decoding (vLLM's spec_decode counters): verify steps, tokens drafted, drafts accepted, and accepted
    # per draft position (accepted_per_pos[i]: steps whose draft token i + 1 was kept)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    def record_step(self, step: int, request_start: float, step_start: float, now: float, tokens: int = 1) -> None:
        """Book one step's wall time (perf_counter seconds): step 0 ends the prefill, later steps are decode steps.
        A decode step that made ``tokens`` tokens (speculative decoding) books its time evenly over them, so token_ms
        holds one entry per token and decode_ms_per_token is per token."""
        if step == 0:
            self.prefill_ms = (now - request_start) * 1000
        else:
            ms = (now - step_start) * 1000
            self.token_ms += [ms / tokens] * tokens
            self.decode_ms += ms

    def record_verify(self, drafted: int, accepted: int) -> None:
        """One speculative verify step: ``drafted`` tokens proposed, the first ``accepted`` of them kept."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        per = self.spec_accepted_per_pos
        per += [0] * (drafted - len(per))
        for i in range(accepted):
            per[i] += 1

    @property
    def decode_ms_per_token(self) -> float:
        steps = len(self.token_ms) + self.token_ms_dropped
        return self.decode_ms / steps if steps else 0.0

    @property
    def hit_rate(self) -> float:
        routed = self.hits + self.misses
        return self.hits / routed if routed else 0.0

    def add(self, s: "GenerationStats", keep_token_ms: int = 1024) -> None:
        """Sum one request's ``s`` into these cumulative stats (hit_rate_by_tier is left to the engine: it
        needs the pairs per tier). Only the last ``keep_token_ms`` step times are kept: a server runs for long."""
        self.prompt_tokens += s.prompt_tokens
        self.cached_tokens += s.cached_tokens
        self.completion_tokens += s.completion_tokens
        self.prefill_ms += s.prefill_ms
        self.decode_ms += s.decode_ms
        steps = self.token_ms + s.token_ms
        self.token_ms_dropped += max(len(steps) - keep_token_ms, 0)
        self.token_ms = steps[-keep_token_ms:]
        self.hits += s.hits
        self.misses += s.misses
        self.host_expert_tokens += s.host_expert_tokens
        for k, v in s.tier_hits.items():
            self.tier_hits[k] = self.tier_hits.get(k, 0) + v
        for k, v in s.bytes_moved.items():
            self.bytes_moved[k] = self.bytes_moved.get(k, 0) + v
        for k, v in s.stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        for k, v in s.disk.items():
            self.disk[k] = self.disk.get(k, 0.0) + v
        self.spec_drafts += s.spec_drafts
        self.spec_draft_tokens += s.spec_draft_tokens
        self.spec_accepted_tokens += s.spec_accepted_tokens
        per = self.spec_accepted_per_pos
        per += [0] * (len(s.spec_accepted_per_pos) - len(per))
        for i, v in enumerate(s.spec_accepted_per_pos):
            per[i] += v
        self.finish_reason = s.finish_reason

    def disk_summary(self) -> dict[str, float]:
        """The disk tier's numbers for these tokens: counters, plus bytes read and stall per generated token, the
        host tier's hit rate (experts asked for that were in host memory) and the prefetcher's precision/recall."""
        d = self.disk
        if not d:
            return {}
        tokens = max(self.prompt_tokens + self.completion_tokens, 1)
        out = {k: round(v, 3) for k, v in d.items()}
        out["disk_bytes_per_token"] = round(d.get("disk_bytes", 0) / tokens)
        out["stall_ms_per_token"] = round(d.get("stall_ms", 0) / tokens, 3)
        out.update({k: round(v, 6) for k, v in disk_rates(d).items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "decode_ms_per_token": round(self.decode_ms_per_token, 3),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 6),
            "hit_rate_by_tier": {k: round(v, 6) for k, v in self.hit_rate_by_tier.items()},
            "bytes_moved": dict(self.bytes_moved),
            "host_expert_tokens": self.host_expert_tokens,
            "stage_ms": {k: round(v, 3) for k, v in self.stage_ms.items()},
        }
        if self.tier_hits:
            out["hits_by_tier"] = dict(self.tier_hits)
        if self.disk:
            out["disk"] = self.disk_summary()
        if self.spec_drafts:
            out["speculative"] = self.spec_summary()
        return out

    def spec_summary(self) -> dict[str, Any]:
        """Speculative decoding's numbers: verify steps, drafted and accepted tokens, the acceptance rate, and the mean
        acceptance length (tokens made per verify step: accepted drafts + the one the target adds)."""
        d = self.spec_drafts
        return {"drafts": d, "draft_tokens": self.spec_draft_tokens, "accepted_tokens": self.spec_accepted_tokens,
                "accepted_per_pos": list(self.spec_accepted_per_pos),
                "acceptance_rate": round(self.spec_accepted_tokens / self.spec_draft_tokens, 4) if self.spec_draft_tokens else 0.0,
                "mean_acceptance_length": round(1 + self.spec_accepted_tokens / d, 4) if d else 0.0}


class Generation(Iterator[int]):
    """Token ids of one request, then ``stats``. ``close()`` aborts it (finish_reason ``abort``).

    Two ways to be fed: from a token iterator (``tokens``: engines that run one request at a time), or by an
    engine's ``step()`` appending to ``pending`` (batching engines; iterating then runs ``drive`` until a token
    comes). Either way a consumer may iterate, or call ``Engine.step()`` and ``drain()`` (the server does).

    With ``params.logprobs`` set, the engine appends one TokenLogprob to ``logprobs`` per token, in token order
    (so ``logprobs[i]`` belongs to completion token i); with ``params.prompt_logprobs`` set, ``prompt_logprobs``
    holds one entry per prompt token (None for the first, which has no context) once the prefill is done."""

    def __init__(self, tokens: Iterator[int] | None, stats: GenerationStats, logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, *, drive=None, on_close=None):
        self._tokens = tokens
        self._drive, self._on_close = drive, on_close
        self._open = None  # Engine.start (serial engines): opens the engine's own generation at the first pull
        self.stats = stats
        self.pending: deque[int] = deque()
        self.done = False  # no more tokens will come (pending may still hold some)
        self.error: BaseException | None = None  # set by a batching engine when this request failed alone
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def __next__(self) -> int:
        while True:
            if self.pending:
                return self.pending.popleft()
            if self.error is not None:
                err, self.error = self.error, None
                raise err
            if self.done:
                raise StopIteration
            if self._open is not None:
                self.pull()
                continue
            if self._tokens is not None:
                try:
                    return next(self._tokens)
                except StopIteration:
                    self.done = True
                    raise
            self._drive()

    def pull(self) -> None:
        """Move one token from the iterator to ``pending`` (or mark done/error): the serial engines' step."""
        try:
            if self._tokens is None and self._open is not None:  # its turn: the engine's generate() now
                inner, self._open = self._open(), None
                self._tokens, self.stats = inner._tokens, inner.stats
                self.logprobs, self.prompt_logprobs = inner.logprobs, inner.prompt_logprobs
            self.pending.append(next(self._tokens))
        except StopIteration:
            self.done = True
        except Exception as e:  # noqa: BLE001 - handed to the consumer, as iterating would
            self.error, self.done = e, True

    def drain(self) -> list[int]:
        """Tokens produced since the last drain."""
        out = list(self.pending)
        self.pending.clear()
        return out

    @property
    def finished(self) -> bool:
        return self.done and not self.pending

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.stats.finish_reason = "abort"
            if self._on_close:
                self._on_close()
            close = getattr(self._tokens, "close", None)
            if close:
                close()


@dataclass(frozen=True)
class EngineInfo:
    """What a server needs to know about a loaded engine."""

    model: str
    backend: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    policy: str = ""
    predicted_hit_rate: Mapping[str, float] = field(default_factory=dict)
    features: frozenset[str] = frozenset()  # the ENGINE_FEATURES this engine honours; requests using others are refused
    approximate: str = ""  # an opt-in approximate mode ("tail_skip=3"): its output is not the model's; "" = exact


class Engine(ABC):
    """One model loaded on one backend. Not thread-safe: one thread calls it.

    ``generate`` starts a request and returns its Generation; iterating it runs the engine. A server instead
    starts several (``start``), calls ``step()`` in a loop and drains each Generation. Engines that batch
    (``batching = True``) run all started requests in each step; the default ``start``/``step`` here run them
    one at a time, in order, one token per step.
    """

    info: EngineInfo
    tokenizer: Any  # a transformers-style tokenizer: encode, decode, apply_chat_template, eos_token_id
    batching = False

    @abstractmethod
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Start decoding ``prompt_ids``; raises ConfigError for ids outside the vocabulary or beyond the context."""

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Queue a request for ``step()``, after ``check_prompt``'s checks. Here (engines that run one request at a
        time) ``generate`` is called when the request's turn comes, as a server calling it in turn would: an
        engine may hold per-request state from ``generate`` on (a routing context, a process's stream)."""
        prompt = list(prompt_ids)
        self.check_prompt(prompt, params)
        gen = Generation(None, GenerationStats(prompt_tokens=len(prompt)))
        gen._open = lambda: self.generate(prompt, params)
        self.__dict__.setdefault("_serial", deque()).append(gen)
        return gen

    def step(self) -> bool:
        """Advance the started requests by one step; False when none is left. Raises on an engine failure."""
        queue: deque = self.__dict__.setdefault("_serial", deque())
        while queue and queue[0].done:
            queue.popleft()
        if not queue:
            return False
        queue[0].pull()
        return True

    def load(self) -> dict[str, Any]:
        """Scheduler state for metrics: running and waiting requests, KV cache usage 0..1."""
        queue = [g for g in self.__dict__.get("_serial", ()) if not g.done]
        return {"running": min(len(queue), 1), "waiting": max(len(queue) - 1, 0), "kv_usage": 0.0}

    def stats(self) -> dict[str, Any]:
        """Cumulative numbers since the engine started (same keys as GenerationStats.to_dict, summed)."""
        return {}

    def health(self) -> str | None:
        """Why the engine cannot serve now (a process or a rank of it that exited), in words; None when it can.
        Cheap and safe from any thread: the worker's /health calls it."""
        return None

    def close(self) -> None:
        """Free the engine's memory and threads."""

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Shared input checks, raising ConfigError with a message a client can act on."""
        if not prompt_ids:
            raise ConfigError("prompt: expected at least one token, got an empty prompt")
        vocab = self.info.vocab_size
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ConfigError(f"prompt token id: expected an integer in 0..{vocab - 1}, got {t!r}")
        missing = [f for f in params.features() if f not in self.info.features]
        if missing:
            raise ConfigError(f"{missing[0]}: not supported by the {self.info.backend} engine "
                              f"(it supports: {', '.join(sorted(self.info.features)) or 'none of the optional features'})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.info.max_model_len:
            raise ConfigError(
                f"This model's maximum context length is {self.info.max_model_len} tokens; the request asks for "
                f"{total} ({len(prompt_ids)} prompt + {params.max_tokens} max_tokens)"
            )


def sample_next(probs_or_logits: Sequence[float], params: SamplingParams, rng: random.Random) -> int:
    """Pure-Python sampler over a list of logits (used by the mock engine; torch engines sample in torch)."""
    logits = list(probs_or_logits)
    if params.greedy:
        return max(range(len(logits)), key=logits.__getitem__)
    scaled = [x / params.temperature for x in logits]
    order = sorted(range(len(scaled)), key=scaled.__getitem__, reverse=True)
    if params.top_k:
        order = order[: params.top_k]
    m = scaled[order[0]]
    weights = [math.exp(scaled[i] - m) for i in order]
    total = sum(weights)
    if params.top_p < 1.0:
        kept, acc = [], 0.0
        for i, w in zip(order, weights):
            kept.append((i, w))
            acc += w / total
            if acc >= params.top_p:
                break
        order, weights = [i for i, _ in kept], [w for _, w in kept]
    return rng.choices(order, weights=weights)[0]


__all__ = ["ENGINE_FEATURES", "FINISH_REASONS", "Engine", "EngineInfo", "Generation", "GenerationStats", "SamplingParams",
           "StructuredOutput", "TokenLogprob", "sample_next"]
