"""Token output: a step's logits -> prompt logprobs, one sampled token per finished-computing sequence, stop checks.

    SchedulerOutput + logits [R, V] (model_runner.py: per scheduled sequence, every chunk position when prompt
    logprobs are owed, else the last position when it samples, else none)
      --prompt_logprobs per chunk; sample (every sampling sequence at once, sampling.py)-->
      token: stop id -> finish "stop" | accepted -> Generation.pending (+ logprobs) -> structured end -> "stop",
      max_tokens -> "length"
    finish: the scheduler frees the blocks, the request's stats get their tier rates (accounting.py)

R rows kept by the forward, V vocabulary size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from moe_offload.engines.base import Generation, GenerationStats
from moe_offload.engines.offload.runtime.accounting import Accounting
from moe_offload.engines.offload.runtime.sampling import SequenceState, prompt_logprobs, sample
from moe_offload.engines.offload.runtime.scheduler import FINISHED, Scheduler, SchedulerOutput
from moe_offload.engines.offload.runtime.scheduler import Sequence as Seq
from moe_offload.engines.params import SamplingParams


@dataclass(eq=False)
class Request:
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


class OutputProcessor:
    """Turns each step's logits into tokens of its sequences, and finishes sequences."""

    def __init__(self, scheduler: Scheduler, accounting: Accounting):
        self.scheduler, self.accounting = scheduler, accounting

    def emit(self, out: SchedulerOutput, logits) -> None:
        """Prompt logprobs of prefill chunks, then one sampled token per sequence whose tokens are all computed.
        ``logits`` [R, V] rows: per scheduled sequence, every chunk position (prompt logprobs owed) or the last
        (it samples); None when no sequence has a row."""
        now = time.perf_counter()
        sampled, rows, r = [], [], 0
        for seq, n in out.scheduled:
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
        for seq, n in out.scheduled:
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
                self.finish(seq, "stop")
                continue
            req.state.accept(token)
            st.completion_tokens += 1
            seq.tokens.append(token)
            if req.gen.logprobs is not None:
                req.gen.logprobs.append(entry)
            req.gen.pending.append(token)
            if req.state.finished:  # a structured output is complete: nothing but EOS could follow
                self.finish(seq, "stop")
            elif st.completion_tokens >= req.params.max_tokens:
                self.finish(seq, "length")

    def finish(self, seq: Seq, reason: str) -> None:
        """Done (``reason``: stop | length | abort, or the one it had when a step failed): free and book it."""
        if seq.state == FINISHED:
            return
        req = seq.payload
        self.scheduler.finish(seq)
        req.cache = None
        req.stats.finish_reason = reason
        req.gen.done = True
        self.accounting.finalise(req.stats)
