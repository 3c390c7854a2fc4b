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

from moe_offload.errors import ConfigError

FINISH_REASONS = ("stop", "length", "abort")
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM): logits / T would overflow to inf -> NaN
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_LOGPROBS = 20  # top-N alternatives per token, as vLLM's default --max-logprobs


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled by the engine into a token mask (llguidance).

    kind ``json``: ``spec`` is a JSON Schema (JSON text); ``json_object``: any JSON object (spec unused);
    ``regex``: a regular expression; ``choice``: a JSON list of strings; ``grammar``: a Lark or GBNF grammar."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ConfigError(f"structured output: expected a kind in {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ConfigError(f"structured output spec: expected a string, got {type(self.spec).__name__}")


def _number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise ConfigError(f"{name}: expected a number in {'(' if lo_open else ''}{lo}..{hi}, got {v!r}")


def _top_n(name: str, v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
        raise ConfigError(f"{name}: expected an integer in 0..{MAX_LOGPROBS} or null, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature`` below 1e-5 (0 included) is greedy; ``top_k == 0``, ``top_p == 1``,
    ``min_p == 0`` and the neutral penalties (0, 0, 1) disable those steps.

    Penalties follow vLLM (and OpenAI): ``presence_penalty`` and ``frequency_penalty`` (-2..2) subtract from the
    logits of tokens already generated (once, and per occurrence); ``repetition_penalty`` (> 0) divides positive
    and multiplies negative logits of tokens in the prompt or the output. ``logit_bias`` adds to the logits of
    token ids; ``min_tokens`` forbids EOS and ``stop_token_ids`` until that many tokens exist. ``logprobs``: the
    number of top alternatives (0..20) to report with each token's own logprob (None: none);
    ``prompt_logprobs`` the same for each prompt token. ``structured`` constrains the output (JSON, regex, ...).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100 or math.isnan(self.temperature):
            raise ConfigError(f"temperature: expected a number in 0..100, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k: expected an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ConfigError(f"seed: expected an integer in {SEED_MIN}..{SEED_MAX} or null, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens: expected an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _top_n("logprobs", self.logprobs)
        _top_n("prompt_logprobs", self.prompt_logprobs)
        # JSON (the engine protocol) brings a mapping or lists; keep one hashable, ordered form.
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = tuple((int(t), float(b)) for t, b in bias)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias: expected token id -> bias pairs, got {self.logit_bias!r}") from None
        for t, b in pairs:
            if t < 0 or math.isnan(b) or not -100 <= b <= 100:
                raise ConfigError(f"logit_bias: expected token ids >= 0 with biases in -100..100, got {t}: {b}")
        object.__setattr__(self, "logit_bias", pairs)
        if isinstance(self.structured, Mapping):
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ConfigError(f"structured: expected a StructuredOutput or null, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def features(self) -> tuple[str, ...]:
        """The optional features (ENGINE_FEATURES) this request uses; an engine that lacks one must refuse it."""
        used = {
            "min_p": self.min_p != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens > 0,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured": self.structured is not None,
        }
        return tuple(k for k, v in used.items() if v)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of the engine protocol: the base fields always, optional features only when used
        (an engine binary written before them keeps working for requests that do not use them)."""
        raw = {f: getattr(self, f) for f in BASE_FIELDS}
        raw["stop_token_ids"] = list(self.stop_token_ids)
        for name in self.features():
            value = getattr(self, name)
            if name == "logit_bias":
                value = {str(t): b for t, b in value}
            elif name == "structured":
                value = {"kind": value.kind, "spec": value.spec}
            raw[name] = value
        return raw


BASE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
ENGINE_FEATURES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "logprobs", "prompt_logprobs", "structured")


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (natural log, fp32 log_softmax of the model's logits before any
    penalty, bias, mask or temperature: vLLM's default "raw" logprobs). ``rank``: 1 + the number of tokens
    more likely than ``token``; ``top``: the N most likely (token id, logprob), most likely first."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationStats:
    """Measured numbers of one request. Times in ms; hit rates are fractions 0..1 of routed
    token-expert pairs served per tier; bytes_moved is host->accelerator copy volume per tier."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "length"
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    token_ms: list[float] = field(default_factory=list)  # wall time of each decode step after the first token
    hits: int = 0
    misses: int = 0
    hit_rate_by_tier: dict[str, float] = field(default_factory=dict)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    host_expert_tokens: int = 0
    stage_ms: dict[str, float] = field(default_factory=dict)
    token_ms_dropped: int = field(default=0, repr=False)  # cumulative stats: step times no longer in token_ms

    def record_step(self, step: int, request_start: float, step_start: float, now: float) -> None:
        """Book one step's wall time (perf_counter seconds): step 0 ends the prefill, later steps are decode steps."""
        if step == 0:
            self.prefill_ms = (now - request_start) * 1000
        else:
            self.token_ms.append((now - step_start) * 1000)
            self.decode_ms += (now - step_start) * 1000

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
        self.completion_tokens += s.completion_tokens
        self.prefill_ms += s.prefill_ms
        self.decode_ms += s.decode_ms
        steps = self.token_ms + s.token_ms
        self.token_ms_dropped += max(len(steps) - keep_token_ms, 0)
        self.token_ms = steps[-keep_token_ms:]
        self.hits += s.hits
        self.misses += s.misses
        self.host_expert_tokens += s.host_expert_tokens
        for k, v in s.bytes_moved.items():
            self.bytes_moved[k] = self.bytes_moved.get(k, 0) + v
        for k, v in s.stage_ms.items():
            self.stage_ms[k] = self.stage_ms.get(k, 0.0) + v
        self.finish_reason = s.finish_reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
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
