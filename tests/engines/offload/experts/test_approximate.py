"""The opt-in approximate modes: tail skip (a token's routed experts ranked tail_skip or lower are dropped when cold)
and cold_dtype (misses computed from an int8 / int4 copy).

Why these could fail: the drop must be per (token, rank, residency), the same whether a step holds one token (its
K shrinks) or many (a dropped pair becomes a zero-weight copy of the token's top pair); a resident expert is never
dropped or lowered, and the exact path must stay exact with the modes off. A cold copy must be read exactly where a
miss is computed on the host (the fused tiers' call and the per-expert path), never for a resident expert.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES

from moe_offload.engines.offload.experts import approximate
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
    new_idx, new_w, ids = approximate.skip_tail(ex, cache, idx, w, idx.reshape(-1).tolist())
    # token 0: rank 0 is expert 1 (kept though cold), expert 3 (rank 1) cold -> dropped, expert 0 resident -> kept
    # token 1: expert 1 (rank 1, cold) dropped;  token 2: expert 1 (rank 1, cold) dropped, expert 3 (rank 2, cold) dropped
    dropped = new_w == 0
    assert dropped.tolist() == [[False, True, False], [False, True, False], [True, False, True]]
    assert new_idx[dropped].tolist() == [1, 0, 2, 2]  # each token's top expert, weight 0
    assert ex.skipped == 4 and ids == new_idx.reshape(-1).tolist()
    one, one_w, one_ids = approximate.skip_tail(ex, cache, idx[:1], w[:1], idx[0].tolist())  # one token: its K shrinks
    assert one.tolist() == [[1, 0]] and torch.equal(one_w, w[:1, [0, 2]]) and one_ids == [1, 0]
    same = approximate.skip_tail(ex, _Cache([0, 1, 2, 3]), idx, w, idx.reshape(-1).tolist())  # every expert resident: nothing to drop
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


def _run(path, **kw):
    """Greedy tokens and prompt logprobs of one prompt, and the engine's approximate label."""
    engine = build_offload_engine(path, policy="static", **kw)
    try:
        g = engine.generate(list(range(5, 29)), SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=0))
        tokens = list(g)
        return tokens, torch.tensor([e.logprob for e in g.prompt_logprobs[1:]]), engine.info.approximate
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_with_no_expert_resident_a_cold_copy_is_the_quantized_run(checkpoints, family):
    """fp32: every expert misses, so the cold int8 copy gives the --expert-dtype int8 run's tokens and logprobs (to the
    rounding of another kernel: that run takes the int8 one-call kernel, the cold copy the per-expert path); every
    expert resident gives the exact run's bit for bit; half and half is neither."""
    path = checkpoints(family)
    cold = _run(path, fraction=0.0, cold_dtype="int8")
    assert cold[2] == "cold_dtype=int8"
    q = _run(path, fraction=0.0, expert_dtype="int8")
    assert cold[0] == q[0] and torch.allclose(cold[1], q[1], atol=1e-5, rtol=0)
    exact, resident = _run(path, fraction=1.0), _run(path, fraction=1.0, cold_dtype="int8")
    assert resident[0] == exact[0] and torch.equal(resident[1], exact[1])
    half, half_exact = _run(path, fraction=0.5, cold_dtype="int8"), _run(path, fraction=0.5)
    assert (half[1] - half_exact[1]).abs().max() > 1e-4 and (half[1] - q[1]).abs().max() > 1e-4


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_fused_tiers_read_the_cold_copy_in_bf16(demo_model_dir, fmt):
    """bf16 on the fused path: resident experts through the bf16 call, misses through the quantized call on the copy."""
    path = str(demo_model_dir)
    cold = _run(path, fraction=0.0, cold_dtype=fmt, dtype="bfloat16")
    q = _run(path, fraction=0.0, expert_dtype=fmt, dtype="bfloat16")
    assert cold[0] == q[0] and torch.equal(cold[1], q[1])
    half = _run(path, fraction=0.5, cold_dtype=fmt, dtype="bfloat16")
    assert not torch.equal(half[1], _run(path, fraction=0.5, dtype="bfloat16")[1])
    both = _run(path, fraction=0.5, cold_dtype=fmt, tail_skip=3, dtype="bfloat16")
    assert both[2] == f"cold_dtype={fmt},tail_skip=3"


def test_a_cold_copy_is_refused_where_it_cannot_apply(checkpoints, quantized_checkpoints):
    with pytest.raises(ConfigError, match="cold_dtype"):
        build_offload_engine(checkpoints("qwen3_moe"), cold_dtype="fp4")
    with pytest.raises(ConfigError, match="float experts only"):  # an MXFP4 release is quantized already
        build_offload_engine(quantized_checkpoints("gpt_oss_mxfp4"), fraction=0.5, cold_dtype="int8")


def test_the_memory_plan_counts_the_cold_copy(checkpoints):
    path = checkpoints("qwen3_moe")
    plans = {}
    for name, kw in (("exact", {}), ("int8", {"expert_dtype": "int8"}), ("cold", {"cold_dtype": "int8"})):
        engine = build_offload_engine(path, fraction=0.5, **kw)
        plans[name] = engine.memory_plan["experts_bytes"]
        engine.close()
    assert plans["cold"] == plans["exact"] + plans["int8"]
