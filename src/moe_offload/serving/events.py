"""Typed events between the engine thread and the HTTP handlers.

    engine thread --Job.push--> StartedEvent? PromptLogprobsEvent? TokenEvent ... (DoneEvent | ErrorEvent)
        --Worker.events (detokenise, stop strings, metrics)--> PromptLogprobsEvent? TextEvent ... Run
        --> completions.collect (JSON) | streaming (SSE)

Frozen and slotted: an event is made once per token on the engine thread and only read after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_offload.engines.base import GenerationStats, TokenLogprob
    from moe_offload.serving.errors import APIError


@dataclass(frozen=True, slots=True)
class StartedEvent:
    """The engine has begun the request (at once for a batching engine, at its turn for a serial one)."""

    t: float  # time.perf_counter() seconds


@dataclass(frozen=True, slots=True)
class PromptLogprobsEvent:
    """The prompt's logprob entries (first position: None), before the first token, when the request asked."""

    logprobs: list


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    t: float  # time.perf_counter() seconds of the step that made it
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The generation ended; ``stats`` is None when it was cancelled before it started (the client is gone)."""

    stats: GenerationStats | None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The generation failed with an HTTP status (a user error, a crashed or downed engine)."""

    error: APIError


JobEvent = StartedEvent | PromptLogprobsEvent | TokenEvent | DoneEvent | ErrorEvent


@dataclass(frozen=True, slots=True)
class TextEvent:
    """New completion text, and the (token id, TokenLogprob | None) of the tokens consumed since the last one."""

    text: str
    entries: list


@dataclass
class Run:
    """One finished generation of one prompt: its text, tokens and logprob entries, and why it ended.
    The last event of ``Worker.events``; ``collect`` fills in ``text``."""

    text: str = ""
    entries: list = field(default_factory=list)  # [(token id, TokenLogprob | None)] of the kept tokens
    prompt_logprobs: list | None = None
    finish: str = "length"
    stop_reason: str | None = None
    stats: object = None
    n: int = 0  # completion tokens (up to and including the one that completed a stop string)
