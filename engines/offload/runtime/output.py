"""Token output: a step's logits -> prompt logprobs, one sampled token per finished-computing sequence, stop checks.

    SchedulerOutput + logits [R, V] (model_runner.py: per scheduled sequence, every chunk position when prompt
    logprobs are owed, else the last position when it samples, else none)
      --prompt_logprobs per chunk; sample (every sampling sequence at once, sampling.py), or verify a sequence's
        draft (speculative.py: the accepted drafts and one more)-->
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
from moe_offload.engines.offload.runtime.speculative import verify
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
        self.released = None  # called with a finished sequence's id (the draft proposer frees its state)

    def emit(self, out: SchedulerOutput, logits) -> None:
        """Prompt logprobs of prefill chunks, then one sampled token per sequence whose tokens are all computed, or
        the tokens a verify step keeps (speculative.py). ``logits`` [R, V] rows: per scheduled sequence, every chunk
        position (prompt logprobs owed, or a draft to verify) or the last (it samples); None when no sequence has a row."""
        now = time.perf_counter()
        sampled, rows, verifying, r = [], [], [], 0
        for seq, n in out.scheduled:
            req = seq.payload
            if seq.draft:
                verifying.append((seq, r, n))
                r += n
                continue
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
        if sampled:
            picks = sample(logits[rows] if len(rows) != logits.shape[0] else logits,
                           [s.payload.state for s in sampled])
            for seq, (token, entry) in zip(sampled, picks):
                self._take(seq, [token], [entry], now)
        for seq, r0, n in verifying:
            draft, seq.draft = seq.draft, []
            tokens, entries = verify(logits[r0 : r0 + n], draft, seq.payload.state)
            seq.computed -= len(draft) - (len(tokens) - 1)  # the rejected drafts' KV rows lie beyond the sequence
            seq.payload.stats.record_verify(len(draft), len(tokens) - 1)
            self._take(seq, tokens, entries, now)

    def _take(self, seq: Seq, tokens: list[int], entries: list, now: float) -> None:
        """Append a step's tokens to ``seq`` in order, until one ends it (a stop id, the grammar, max_tokens)."""
        req = seq.payload
        st = req.stats
        keep = len(tokens)
        for i, t in enumerate(tokens):
            if t in req.stops or st.completion_tokens + i + 1 >= req.params.max_tokens:
                keep = i + 1
                break
        st.record_step(0 if req.t_last == 0.0 else 1, req.t_start, req.t_last, now, keep)  # 0: ends the prefill
        req.t_last = now
        for token, entry in zip(tokens[:keep], entries):
            if token in req.stops:
                self.finish(seq, "stop")
                return
            req.state.accept(token)
            st.completion_tokens += 1
            seq.tokens.append(token)
            if req.gen.logprobs is not None:
                req.gen.logprobs.append(entry)
            req.gen.pending.append(token)
            if req.state.finished:  # a structured output is complete: nothing but EOS could follow
                self.finish(seq, "stop")
                return
            if st.completion_tokens >= req.params.max_tokens:
                self.finish(seq, "length")
                return

    def finish(self, seq: Seq, reason: str) -> None:
        """Done (``reason``: stop | length | abort, or the one it had when a step failed): free and book it."""
        if seq.state == FINISHED:
            return
        req = seq.payload
        self.scheduler.finish(seq)
        seq.draft = []
        if self.released is not None:
            self.released(seq.sid)
        req.cache = None
        req.stats.finish_reason = reason
        req.gen.done = True
        self.accounting.finalise(req.stats)
