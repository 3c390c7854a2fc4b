"""A deterministic engine without a model: for tests, the serving stack and orchestrators.

Same prompt, seed and params -> same tokens. ``ms_per_token`` is slept per
decode step and ``hit_rate`` is the fraction of simulated routed
token-expert pairs that hit; the stats have the same shape as a real
engine's, and the times in them are measured, not copied from the settings.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from moe_offload.engines.base import Engine, EngineInfo, Generation, GenerationStats, TokenLogprob, sample_next
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError

WORDS = ("the", "expert", "routes", "tokens", "to", "memory", "host", "cache", "fast", "model", "layer", "slot")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is EOS. Enough of the transformers tokenizer API for the server."""

    eos_token_id = 256
    eos_token = "</s>"
    vocab_size = 257
    chat_template = "mock"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **kw):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


@dataclass(frozen=True)
class MockConfig:
    ms_per_token: float = 5.0
    hit_rate: float = 0.85
    layers: int = 4
    top_k: int = 8
    expert_bytes: int = 3 * 1024 * 512 * 2
    max_model_len: int = 4096
    policy: str = "static"

    def __post_init__(self):
        if not 0 <= self.ms_per_token <= 60_000:
            raise ConfigError(f"mock ms_per_token: expected 0..60000, got {self.ms_per_token!r}")
        if not 0 <= self.hit_rate <= 1:
            raise ConfigError(f"mock hit_rate: expected a fraction in 0..1, got {self.hit_rate!r}")


class MockEngine(Engine):
    def __init__(self, config: MockConfig | None = None, model: str = "mock", tier: str = "mock:0"):
        self.config = config or MockConfig()
        self.tier = tier
        self.tokenizer = ByteTokenizer()
        self.info = EngineInfo(
            model=model,
            backend="mock",
            vocab_size=ByteTokenizer.vocab_size,
            max_model_len=self.config.max_model_len,
            eos_token_ids=(ByteTokenizer.eos_token_id,),
            policy=self.config.policy,
            predicted_hit_rate={tier: self.config.hit_rate},
            features=frozenset({"logprobs", "prompt_logprobs"}),
        )
        self._total = GenerationStats()
        self._pairs_seen = 0
        self._hits_given = 0

    def _route(self, stats: GenerationStats, tokens: int) -> None:
        # Hits are handed out so that the running ratio tracks hit_rate exactly (no randomness).
        pairs = tokens * self.config.layers * self.config.top_k
        self._pairs_seen += pairs
        hits = round(self._pairs_seen * self.config.hit_rate) - self._hits_given
        self._hits_given += hits
        misses = pairs - hits
        stats.hits += hits
        stats.misses += misses
        if self.config.policy == "lru":
            stats.bytes_moved[self.tier] = stats.bytes_moved.get(self.tier, 0) + misses * self.config.expert_bytes
        else:
            stats.host_expert_tokens += misses

    def _logits(self, history: Sequence[int], seed: int) -> list[float]:
        digest = hashlib.blake2b(repr((seed, tuple(history[-16:]), len(history))).encode(), digest_size=8).digest()
        rng = random.Random(digest)
        # Favour the bytes of a few words so the text is readable.
        word = WORDS[rng.randrange(len(WORDS))]
        logits = [rng.random() for _ in range(self.info.vocab_size)]
        for b in (word + " ").encode():
            logits[b] += 4.0
        logits[ByteTokenizer.eos_token_id] = -1.0
        return logits

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.check_prompt(prompt_ids, params)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        lps = [] if params.logprobs is not None else None
        plps = None
        if params.prompt_logprobs is not None:
            seed = params.seed if params.seed is not None else 0
            plps = [None] + [_entry(self._logits(prompt_ids[:t], seed), prompt_ids[t], params.prompt_logprobs)
                             for t in range(1, len(prompt_ids))]
        return Generation(self._run(list(prompt_ids), params, stats, lps), stats, lps, plps)

    def _run(self, history: list[int], params: SamplingParams, stats: GenerationStats, lps: list | None):
        seed = params.seed if params.seed is not None else 0
        rng = random.Random(seed)
        t0 = time.perf_counter()
        self._route(stats, len(history))
        try:
            for i in range(params.max_tokens):
                step0 = time.perf_counter()
                if i > 0 and self.config.ms_per_token:
                    time.sleep(self.config.ms_per_token / 1000)
                logits = self._logits(history, seed)
                token = sample_next(logits, params, rng)
                history.append(token)
                if i > 0:
                    self._route(stats, 1)
                stats.record_step(i, t0, step0, time.perf_counter())
                stop = token in params.stop_token_ids or (not params.ignore_eos and token in self.info.eos_token_ids)
                if stop:
                    stats.finish_reason = "stop"
                    return
                stats.completion_tokens += 1
                if lps is not None:
                    lps.append(_entry(logits, token, params.logprobs))
                yield token
            stats.finish_reason = "length"
        finally:
            routed = stats.hits + stats.misses
            stats.hit_rate_by_tier = {self.tier: stats.hits / routed if routed else 0.0}
            stats.stage_ms = {"experts": stats.decode_ms + stats.prefill_ms}
            self._accumulate(stats)

    def _accumulate(self, s: GenerationStats) -> None:
        t = self._total
        t.add(s)
        routed = t.hits + t.misses
        t.hit_rate_by_tier = {self.tier: t.hits / routed if routed else 0.0}

    def stats(self):
        return self._total.to_dict()


def _entry(logits: list[float], token: int, n: int) -> TokenLogprob:
    """The logprob entry of ``token`` under ``logits`` (log_softmax in float64), with the top ``n``."""
    m = max(logits)
    lse = m + math.log(sum(math.exp(x - m) for x in logits))
    lp = [x - lse for x in logits]
    order = sorted(range(len(lp)), key=lambda i: -lp[i])
    return TokenLogprob(token, lp[token], 1 + sum(v > lp[token] for v in lp), tuple((i, lp[i]) for i in order[:n]))
