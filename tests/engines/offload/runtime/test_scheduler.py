"""The step scheduler without a model: admission, prefill chunks, decode tokens first, preemption and recompute,
over the real block pool (kv.KVPool: no tensor is allocated until a layer writes).

``step`` plays the engine's part after each forward: the scheduled tokens become computed, and a sequence whose
tokens are all computed gets one sampled token (what output.py appends), so its next step is a decode.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_offload.engines.offload.runtime.kv import KVPool
from moe_offload.engines.offload.runtime.scheduler import (
    FINISHED,
    RUNNING,
    WAITING,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)
from moe_offload.errors import ConfigError


def make(blocks: int, block_size: int, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVPool(blocks, block_size, torch.device("cpu")))


def seq(sid: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(sid, list(range(100 + sid * 10, 100 + sid * 10 + prompt_len)), prompt_len, prompt_len + max_tokens)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    for sq, n in out.scheduled:
        sq.computed += n
        if sq.computed == len(sq.tokens):
            sq.tokens.append(7)
    return out


def shape(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(sq.sid, n) for sq, n in out.scheduled]


def test_admission_stops_at_max_num_seqs_and_resumes_when_a_seat_frees():
    s = make(16, 4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(0, 4), seq(1, 4), seq(2, 4)
    for x in (a, b, c):
        s.add(x)
    out = step(s)
    assert shape(out) == [(0, 4), (1, 4)]  # c would fit the budget and the blocks: only the seats stop it
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (0, 8)
    assert s.running == [a, b] and list(s.waiting) == [c] and c.state == WAITING
    s.finish(a)
    out = step(s)
    assert shape(out) == [(1, 1), (2, 4)]  # b decodes, c takes a's seat
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 4)


def test_prefill_is_chunked_under_the_token_budget():
    s = make(16, 4, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = seq(0, 10), seq(1, 5)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [(0, 8)]  # the budget is spent: b does not start
    assert list(s.waiting) == [b] and a.computed == 8 and len(a.blocks) == 2
    assert shape(step(s)) == [(0, 2), (1, 5)]  # a's last chunk, then b in what is left (8 - 2)
    out = step(s)
    assert shape(out) == [(0, 1), (1, 1)] and out.num_decode_tokens == 2 and out.decode_only


def test_without_chunking_a_long_prompt_runs_whole_in_a_step_of_its_own():
    # chunked_prefill False (a model whose layers keep state beyond KV): a prompt never splits
    s = make(16, 4, max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=False)
    a, b = seq(0, 10), seq(1, 5)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [(0, 10)]  # over the budget, but alone in the step
    assert shape(step(s)) == [(0, 1), (1, 5)]  # b whole in the 7 tokens left


def test_decode_tokens_come_first_and_prefill_gets_what_is_left():
    s = make(16, 4, max_num_seqs=4, max_num_batched_tokens=4)
    a, b, c = seq(0, 2), seq(1, 2), seq(2, 3)
    for x in (a, b, c):
        s.add(x)
    assert shape(step(s)) == [(0, 2), (1, 2)]
    out = step(s)
    # two decode tokens are taken before the budget of 4 goes to prefill: c gets a 2-token chunk, not 3
    assert shape(out) == [(0, 1), (1, 1), (2, 2)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (2, 2) and not out.decode_only


def test_waiting_sequences_are_admitted_in_order_when_blocks_allow():
    s = make(3, 2, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = seq(0, 3), seq(1, 3), seq(2, 1)
    for x in (a, b, c):
        s.add(x)
    out = step(s)
    # a takes 2 of the 3 blocks; b needs 2 and waits; c needs 1 that is free but does not overtake b
    assert shape(out) == [(0, 3)] and list(s.waiting) == [b, c] and s.pool.free_blocks == 1
    s.finish(a)
    assert shape(step(s)) == [(1, 3), (2, 1)]


def test_the_youngest_is_preempted_when_blocks_run_out_and_recomputed_later():
    s = make(4, 2, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = seq(0, 3), seq(1, 3)
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [(0, 3), (1, 3)] and s.pool.free_blocks == 0
    assert shape(step(s)) == [(0, 1), (1, 1)]  # position 3 still fits the second block of each
    out = step(s)
    # a's position 4 needs a third block: b, the youngest, gives its two back and waits for a recompute
    assert shape(out) == [(0, 1)] and out.preempted == (b,)
    assert b.state == WAITING and b.computed == 0 and b.blocks == [] and list(s.waiting) == [b]
    assert len(a.blocks) == 3 and s.pool.free_blocks == 1
    assert s.preemptions == 1 and b.preemptions == 1
    assert b.tokens == [110, 111, 112, 7, 7]  # its output so far stays: the recompute prefills it
    s.finish(a)
    out = step(s)
    assert shape(out) == [(1, 5)] and out.num_prefill_tokens == 5 and out.preempted == ()
    assert b.state == RUNNING and b.computed == 5 and len(b.tokens) == 6  # the recompute ends in a sampled token


def test_a_youngest_sequence_that_needs_a_block_preempts_itself():
    s = make(4, 2, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = seq(0, 3), seq(1, 4)
    s.add(a)
    s.add(b)
    step(s)
    out = step(s)
    # a's position 3 fits its blocks; b's position 4 needs a block and b is the youngest: it yields, a keeps going
    assert shape(out) == [(0, 1)] and out.preempted == (b,) and s.running == [a]
    assert s.pool.free_blocks == 2  # b's blocks are free, but its recompute (5 tokens, 3 blocks) does not fit yet


def test_finish_frees_the_blocks_wherever_the_sequence_is():
    s = make(4, 2, max_num_seqs=1, max_num_batched_tokens=16)
    a, b = seq(0, 3), seq(1, 2)
    s.add(a)
    s.add(b)
    step(s)
    assert s.pool.free_blocks == 2 and list(s.waiting) == [b]
    s.finish(a)
    s.finish(b)  # still waiting: leaves the queue
    assert s.pool.free_blocks == 4 and not s.running and not s.waiting
    assert a.state == b.state == FINISHED and a.blocks == []
    s.finish(a)  # twice is harmless: nothing is freed twice
    assert s.pool.free_blocks == 4
    assert s.schedule().is_empty


def test_nothing_to_do_is_an_empty_output():
    out = make(4, 2).schedule()
    assert out == SchedulerOutput() and out.is_empty and out.num_decode_tokens == out.num_prefill_tokens == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.num_decode_tokens = 1


@pytest.mark.parametrize(("options", "match"), [
    ({"max_num_seqs": 0}, "max_num_seqs: expected an integer >= 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens: expected an integer >= 1, got 0"),
    ({"max_num_seqs": True}, "max_num_seqs: expected an integer >= 1, got True"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"),
])
def test_a_budget_too_small_for_one_decode_token_per_seat_is_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(**options)
