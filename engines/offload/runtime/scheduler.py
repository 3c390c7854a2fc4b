"""The step scheduler: which sequences run in the next forward, and how many of their tokens.

    waiting (FIFO; preempted sequences go back to its front) --admit when blocks and seats allow-->
    running --schedule(): every decode token, then prefill chunks up to the token budget--> SchedulerOutput
      (scheduled [(sequence, tokens)] in forward order, decode and prefill token counts, preempted sequences)
    a running sequence that needs a block when none is free preempts the youngest running one
    (recompute: its blocks are freed, it is re-prefilled later from prompt + output so far)

Each sequence computes the tokens it has not cached yet: after admission that is its prompt (in
chunks of at most ``max_num_batched_tokens``), then one token per step. A chunk that reaches the end
of the sequence's tokens gives logits, so the step samples its next token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from moe_offload.errors import ConfigError, require_count

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's names: ``max_num_seqs`` sequences decode together; a step computes at most
    ``max_num_batched_tokens`` tokens (prefill chunks fill what decode leaves)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True

    def __post_init__(self):
        require_count("max_num_seqs", self.max_num_seqs, optional=False)
        require_count("max_num_batched_tokens", self.max_num_batched_tokens, optional=False)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}): every running sequence decodes one token per step")


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it. ``tokens`` = prompt + output; ``computed`` of them are in the cache."""

    sid: int
    tokens: list[int]
    prompt_len: int
    max_len: int  # prompt + max_tokens: the most tokens it will ever hold
    payload: Any = None  # the engine's per-request state (params, generation, stats, ...)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    state: str = WAITING
    preemptions: int = 0
    draft: list[int] = field(default_factory=list)  # speculative tokens after ``tokens``, verified by the next step
    # prefix caching (prefix_cache.py): may it take cached blocks (not when every prompt position's logits are owed);
    # its cache_salt; the hash chain of its full blocks so far; blocks of it stored in (or found in) the cache; the
    # prompt tokens found cached at its first admission (usage.prompt_tokens_details.cached_tokens)
    cacheable: bool = True
    salt: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    stored: int = 0
    cached_tokens: int | None = None

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.computed

    def window(self, n: int) -> list[int]:
        """The ``n`` tokens a step computes from ``computed`` on: its own, then its draft."""
        c = self.computed
        own = self.tokens[c : c + n]
        return own + self.draft[: n - len(own)]

    @property
    def contiguous(self) -> bool:
        b = self.blocks
        return not b or b[-1] - b[0] == len(b) - 1 and all(y == x + 1 for x, y in zip(b, b[1:]))


class ScheduledSequence(NamedTuple):
    """One sequence's part of a step: ``num_tokens`` of its tokens from ``seq.computed`` on."""

    seq: Sequence
    num_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, as ``schedule()`` decides it (vLLM v1's ``SchedulerOutput``). ``scheduled``: forward order,
    decode tokens first, then prefill chunks; ``preempted``: sequences preempted during this call (sent back to waiting; one may have been re-admitted as a
    prefill chunk later in the same call, and then is in ``scheduled`` too)."""

    scheduled: tuple[ScheduledSequence, ...] = ()
    num_decode_tokens: int = 0  # one per running sequence whose prompt is cached, + its draft
    num_prefill_tokens: int = 0  # prompt (or recompute) chunks
    preempted: tuple[Sequence, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        """Every sequence computes one token of its own (a decode, or a one-token prefill chunk) and its draft, if
        it has one: the fused decode path's shape (a draft's tokens are rows of the step, as other sequences' are)."""
        return all(n == 1 + len(seq.draft) for seq, n in self.scheduled)


class Scheduler:
    """Admission, chunking and preemption over a block pool (``pool``: free_blocks, blocks_for, allocate, free)."""

    def __init__(self, config: SchedulerConfig, pool):
        self.config, self.pool = config, pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence (done, aborted or failed) wherever it is."""
        if seq.state == RUNNING:
            self.running.remove(seq)
        elif seq.state == WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.pool.free(seq.blocks)
        self.pool.release(seq.sid)
        seq.blocks = []
        seq.state = FINISHED

    def schedule(self) -> SchedulerOutput:
        """The next step; ``is_empty`` when there is nothing to do."""
        budget = self.config.max_num_batched_tokens
        step: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        # 1. one decode token for every running sequence that has its prompt cached, oldest first, plus its draft
        #    (speculative decoding) while the budget leaves one token for each decode after it; when blocks run out
        #    the youngest running sequence is preempted (it is never one already in this step)
        decoding = [s for s in self.running if s.remaining == 1]
        for i, seq in enumerate(decoding):
            if seq.state != RUNNING:
                continue
            del seq.draft[max(budget - (len(decoding) - i), 0):]
            n = 1 + len(seq.draft)
            if self._grow(seq, seq.computed + n, preempted):
                step.append(ScheduledSequence(seq, n))
                budget -= n
        decode = len(step)
        # 2. prefill chunks of running sequences, then of newly admitted ones (FIFO, no overtaking); a prefill
        #    chunk never preempts: it waits for blocks
        for seq in [s for s in self.running if s.remaining > 1]:
            n = self._chunk(seq, budget)
            if n and self._fits(seq, seq.computed + n):
                step.append(ScheduledSequence(seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            found = self._match(seq)
            n = self._chunk(seq, budget)
            if not n or not self._fits(seq, seq.computed + n):
                self._unmatch(seq)
                break
            self._count(seq, found)
            self.waiting.popleft()
            seq.state = RUNNING
            self.running.append(seq)
            step.append(ScheduledSequence(seq, n))
            budget -= n
        return SchedulerOutput(tuple(step), sum(n for _, n in step[:decode]), sum(n for _, n in step[decode:]),
                               tuple(preempted))

    def commit(self, out: SchedulerOutput) -> None:
        """After a step's forward, before its tokens are emitted: every block the step filled with rows of the
        sequence's own tokens (not its draft) goes into the prefix cache."""
        cache = self.pool.cache
        if cache is None:
            return
        bs = cache.block_size
        for seq, n in out.scheduled:
            full = min(seq.computed + n, len(seq.tokens)) // bs
            if full <= seq.stored:
                continue
            hashes = cache.chain(seq.tokens, full * bs, seq.salt, seq.hashes)
            for i in range(seq.stored, full):
                cache.store(seq.blocks[i], hashes[i], hashes[i - 1] if i else None, seq.tokens[i * bs : (i + 1) * bs])
            seq.stored = full

    def _match(self, seq: Sequence) -> int:
        """A sequence about to be admitted with nothing computed takes the cached blocks of its longest cached
        prefix of full blocks, short of its last token (whose logits the step must give); the tokens found."""
        cache = self.pool.cache
        if cache is None or seq.computed or seq.blocks or not seq.cacheable:
            return 0
        upto = len(seq.tokens) - 1
        found = cache.lookup(cache.chain(seq.tokens, upto, seq.salt, seq.hashes)[: upto // cache.block_size])
        if found:
            self.pool.share(found)
            seq.blocks, seq.computed = list(found), len(found) * cache.block_size
        seq.stored = len(found)
        return seq.computed

    def _unmatch(self, seq: Sequence) -> None:
        """The sequence stays waiting: it holds no blocks there (it looks them up again at its next admission)."""
        if seq.blocks and seq.state == WAITING:
            self.pool.free(seq.blocks)
            seq.blocks, seq.computed, seq.stored = [], 0, 0

    def _count(self, seq: Sequence, found: int) -> None:
        cache = self.pool.cache
        if cache is None or not seq.cacheable:
            return
        cache.queries += len(seq.tokens)
        cache.hits += found
        if seq.cached_tokens is None:
            seq.cached_tokens = min(found, seq.prompt_len)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if self.config.chunked_prefill:
            return min(seq.remaining, budget)
        return seq.remaining if seq.remaining <= budget or budget == self.config.max_num_batched_tokens else 0

    def _fits(self, seq: Sequence, tokens: int) -> bool:
        """Allocate the blocks for ``tokens`` rows of ``seq`` if they are free; never preempts."""
        need = self.pool.blocks_for(tokens) - len(seq.blocks)
        if need > self.pool.free_blocks:
            return False
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        return True

    def _grow(self, seq: Sequence, tokens: int, preempted: list[Sequence]) -> bool:
        """Blocks for ``tokens`` rows of ``seq``, preempting the youngest running sequences (added to ``preempted``)
        until they are free. False when ``seq`` itself was the one preempted."""
        while not self._fits(seq, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop its cache, requeue it first; its tokens so far are re-prefilled later."""
        self.running.remove(seq)
        self.pool.free(seq.blocks)
        self.pool.release(seq.sid)
        seq.blocks, seq.computed, seq.state, seq.stored = [], 0, WAITING, 0
        seq.draft.clear()
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
