"""Tail skip, an opt-in approximate mode: a token's routed experts ranked tail_skip or lower are dropped when cold.

Why these could fail: the drop must be per (token, rank, residency), the same whether a step holds one token (its
K shrinks) or many (a dropped pair becomes a zero-weight copy of the token's top pair); a resident expert is never
dropped, and the exact path must stay exact with the mode off.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES

from moe_offload.engines.offload.experts.executor import Executor
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError


class _Cache:
    def __init__(self, slot_of):
        self.slot_of = slot_of


def test_only_cold_pairs_at_or_below_the_rank_are_dropped():
    ex = Executor(torch.device("cpu"), "static", ("acc", "host"), None)
    ex.tail_skip = 1
    cache = _Cache([0, -1, 1, -1])  # experts 0 and 2 resident
    idx = torch.tensor([[1, 3, 0], [0, 1, 2], [3, 2, 1]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.1, 0.7, 0.2]])
    new_idx, new_w, ids = ex.skip_tail(cache, idx, w, idx.reshape(-1).tolist())
    # token 0: rank 0 is expert 1 (kept though cold), expert 3 (rank 1) cold -> dropped, expert 0 resident -> kept
    # token 1: expert 1 (rank 1, cold) dropped;  token 2: expert 1 (rank 1, cold) dropped, expert 3 (rank 2, cold) dropped
    dropped = new_w == 0
    assert dropped.tolist() == [[False, True, False], [False, True, False], [True, False, True]]
    assert new_idx[dropped].tolist() == [1, 0, 2, 2]  # each token's top expert, weight 0
    assert ex.skipped == 4 and ids == new_idx.reshape(-1).tolist()
    one, one_w, one_ids = ex.skip_tail(cache, idx[:1], w[:1], idx[0].tolist())  # one token: its K shrinks
    assert one.tolist() == [[1, 0]] and torch.equal(one_w, w[:1, [0, 2]]) and one_ids == [1, 0]
    same = ex.skip_tail(_Cache([0, 1, 2, 3]), idx, w, idx.reshape(-1).tolist())  # every expert resident: nothing to drop
    assert torch.equal(same[0], idx) and torch.equal(same[1], w)


def _prompt_logprobs(path, **kw) -> list[float]:
    engine = build_offload_engine(path, policy="static", fraction=0.5, max_num_seqs=1, **kw)
    try:
        g = engine.generate(list(range(5, 29)), SamplingParams(max_tokens=1, prompt_logprobs=0))
        list(g)
        return [e.logprob for e in g.prompt_logprobs[1:]], engine.stats(), engine.info
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_of_many_tokens_skips_as_one_token_steps_do(checkpoints, family):
    """The prompt's logprobs with tail skip prefilled in one step (many tokens) equal those prefilled one token a
    step (one-token steps, where K shrinks), and differ from the exact run's: the mode did something, the same thing."""
    path = checkpoints(family)
    exact, st, info = _prompt_logprobs(path, max_num_batched_tokens=64)
    many, st_many, info_many = _prompt_logprobs(path, max_num_batched_tokens=64, tail_skip=1)
    ones, st_ones, _ = _prompt_logprobs(path, max_num_batched_tokens=1, tail_skip=1)
    assert info.approximate == "" and "approximate" not in st
    assert info_many.approximate == "tail_skip=1" and st_many["approximate"]["skipped_pairs"] > 0
    assert st_ones["approximate"]["skipped_pairs"] == st_many["approximate"]["skipped_pairs"]
    assert torch.allclose(torch.tensor(many), torch.tensor(ones), atol=1e-4)
    assert (torch.tensor(many) - torch.tensor(exact)).abs().max() > 1e-3


def test_every_expert_resident_leaves_nothing_to_skip(checkpoints):
    path = checkpoints("qwen3_moe")
    outs = []
    for skip in (None, 1):
        engine = build_offload_engine(path, fraction=1.0, tail_skip=skip)
        try:
            outs.append(list(engine.generate([3, 17, 42, 9], SamplingParams(max_tokens=12, ignore_eos=True))))
            if skip:
                assert engine.stats()["approximate"]["skipped_pairs"] == 0
        finally:
            engine.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_bad_rank_is_refused_before_loading(bad):
    with pytest.raises(ConfigError, match="tail_skip"):
        build_offload_engine("/nonexistent", tail_skip=bad)
