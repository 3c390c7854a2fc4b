"""What a request asks of an engine: sampling parameters, structured output, and the optional features.

    API request (serving/requests.py) | CLI | ai-rm config --> SamplingParams (validated) --> Engine.generate

Validation happens here, once, with ConfigError messages that say expected versus got; engines trust it.
Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
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
    speculative: bool = True  # False: never draft tokens for this request (an engine without speculation ignores it)
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached blocks (vLLM's)

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
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ConfigError(f"cache_salt: expected a non-empty string or null, got {self.cache_salt!r}")
        if not isinstance(self.speculative, bool):
            raise ConfigError(f"speculative: expected true or false, got {self.speculative!r}")

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
        return raw  # ``speculative`` stays here: it steers this package's engine; a process engine never drafts


BASE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
ENGINE_FEATURES = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "logprobs", "prompt_logprobs", "structured")


METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16
DISABLE_BY_BATCH_SIZE = 2  # measured on the trained demo: from 2 streams on drafts cost more than they save


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: ``method`` ngram | draft_model | mtp (the checkpoint's own next-token prediction
    layer, model/mtp.py; one draft a step), ``num_speculative_tokens`` k drafted per step,
    ``prompt_lookup_min/max`` the n-gram lengths tried (ngram), ``model`` the draft checkpoint (draft_model),
    ``disable_by_batch_size``: no drafts while this many sequences or more decode together (a batched step already
    reads each expert once for many tokens; docs/benchmarks/speculative.md measures where drafts stop paying)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # chosen from docs/benchmarks/speculative.md: most of k=6's gain, less waste
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative method: expected one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens: expected an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ConfigError(f"prompt_lookup_min/max: expected integers 1 <= min <= max, got {lo!r}, {hi!r}")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError(f"disable_by_batch_size: expected an integer >= 1 or null, got {b!r}")
        if (self.method == "draft_model") != bool(self.model):
            raise ConfigError("speculative: method draft_model takes a 'model' (the draft checkpoint), the others none")
        if self.method == "mtp" and k != 1:
            raise ConfigError(f"speculative method mtp: one draft a step (num_speculative_tokens 1, the checkpoint's "
                              f"first MTP layer), got {k}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from JSON text (the CLI's --speculative-config), a mapping, or None / "" (off)."""
        if value is None or value == "" or isinstance(value, cls):
            return value or None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config: expected a JSON object, got {value!r} ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative config: expected a JSON object, got {value!r}")
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft_model"}
        if value.get("method") == "mtp" and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": 1}  # the checkpoints ship one layer: one draft a step
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"speculative config: unknown key(s) {', '.join(sorted(unknown))}; valid: "
                              f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**value)

    def to_dict(self) -> dict:
        d = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
             "disable_by_batch_size": self.disable_by_batch_size}
        if self.method == "ngram":
            d |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        elif self.method == "draft_model":
            d["model"] = self.model
        return d
