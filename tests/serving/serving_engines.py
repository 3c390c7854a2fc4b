"""Test engines built on the mock: per-class hit rates, a thinking model, a crashing one."""

from __future__ import annotations

from moe_offload.engines.base import Generation, GenerationStats
from moe_offload.engines.mock import ByteTokenizer, MockConfig, MockEngine
from moe_offload.serving.classify import classify


class ClassAwareMock(MockEngine):
    """Hit rate depends on the prompt's class, as it would for a placement tuned to some classes."""

    def __init__(self, rates: dict[str, float], default: float = 0.5, ms_per_token: float = 1.0, predicted: float = 0.9):
        super().__init__(MockConfig(ms_per_token=ms_per_token, hit_rate=predicted))
        self.rates, self.default, self._rate = rates, default, default

    def generate(self, prompt_ids, params):
        self._rate = self.rates.get(classify(self.tokenizer.decode(prompt_ids)), self.default)
        return super().generate(prompt_ids, params)

    def _route(self, stats, tokens):
        pairs = tokens * self.config.layers * self.config.top_k
        hits = round(pairs * self._rate)
        stats.hits += hits
        stats.misses += pairs - hits
        stats.host_expert_tokens += pairs - hits


class ThinkingTokenizer(ByteTokenizer):
    chat_template = "{{ messages }}<think>"  # a template that knows <think> switches the reasoning split on


class ThinkingMock(MockEngine):
    """Answers every prompt with a fixed reply that reasons first."""

    REPLY = "<think>Let me think.</think>\n\nThe answer is 4."

    def __init__(self):
        super().__init__(MockConfig(ms_per_token=0))
        self.tokenizer = ThinkingTokenizer()

    def generate(self, prompt_ids, params):
        self.check_prompt(prompt_ids, params)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))

        def run():
            for i, b in enumerate(self.REPLY.encode()):
                if i >= params.max_tokens:
                    return
                stats.completion_tokens += 1
                stats.hits += 1
                yield b
            stats.finish_reason = "stop"

        return Generation(run(), stats)


class CrashingMock(MockEngine):
    """Raises (an engine bug) on any prompt containing CRASH."""

    def __init__(self):
        super().__init__(MockConfig(ms_per_token=0))

    def generate(self, prompt_ids, params):
        if b"CRASH" in bytes(t for t in prompt_ids if t < 256):
            raise RuntimeError("simulated engine failure")
        return super().generate(prompt_ids, params)


class HangingMock(MockEngine):
    """A step that blocks until ``release`` is set (a hung kernel, a rank that stopped answering), and an engine that
    reports what ``dead`` says through health() (a process or rank that exited)."""

    def __init__(self):
        import threading

        super().__init__(MockConfig(ms_per_token=0))
        self.release, self.dead = threading.Event(), None

    def step(self) -> bool:
        self.release.wait(30)
        return super().step()

    def health(self) -> str | None:
        return self.dead
