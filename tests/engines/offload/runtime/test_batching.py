"""Exactness under continuous batching: in fp32, each sequence of a batch gets transformers' own greedy tokens,
whether it starts first, joins mid-way, finishes early, or is preempted and recomputed.

Why these could fail: a batched step packs several sequences into one forward, so a wrong key layout, a mask
that lets one sequence see another's keys, or a wrong position would change tokens; a preempted sequence must
be re-prefilled from prompt + output exactly.
"""

from __future__ import annotations

import pytest
from offload_helpers import FAMILIES, greedy, staggered, stock
from offload_helpers import references as shared_references

from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70])
LENGTHS = (20, 6, 14)  # the second finishes early; the third joins after two steps and runs past the first


def references(checkpoints, family):
    return shared_references(checkpoints(family), PROMPTS, LENGTHS)


def run_staggered(engine, prompts=PROMPTS, lengths=LENGTHS, join_after=2):
    return staggered(engine, prompts, lengths, join_after)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["static", "lru", "hybrid"])
def test_batched_sequences_match_transformers(checkpoints, family, policy):
    expected = references(checkpoints, family)
    engine = build_offload_engine(checkpoints(family), policy=policy, fraction=0.5, max_num_batched_tokens=16)
    try:
        assert engine.paged  # every family here keeps only attention KV: the batched path, not the fallback
        out, gens = run_staggered(engine)
    finally:
        engine.close()
    assert out == expected
    for g, n in zip(gens, LENGTHS):
        assert g.stats.completion_tokens == n and g.stats.finish_reason == "length"
        assert g.stats.hits + g.stats.misses > 0


def test_per_sequence_fallback_batches_the_same_tokens(checkpoints):
    expected = references(checkpoints, "qwen3_moe")
    assert staggered_per_sequence(checkpoints("qwen3_moe"), cache="dynamic") == expected


def staggered_per_sequence(path, **options) -> list[list[int]]:
    """run_staggered on the per-sequence path (the model's own cache per sequence), LRU at half the experts."""
    engine = build_offload_engine(path, policy="lru", fraction=0.5, **options)
    try:
        assert not engine.paged
        return run_staggered(engine)[0]
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_preempted_sequences_are_recomputed_exactly(checkpoints, family):
    """A pool of 4 blocks of 4 tokens (16 rows) cannot hold the three sequences at once: the youngest is preempted,
    requeued and re-prefilled from its prompt and output so far."""
    expected = references(checkpoints, family)
    budget = _bytes_for_blocks(checkpoints(family), 4, 9)
    engine = build_offload_engine(checkpoints(family), block_size=4, kv_cache_memory=budget, max_num_batched_tokens=16)
    try:
        assert engine.pool.num_blocks == 9 and engine.info.max_model_len == 36
        out, _ = run_staggered(engine)
        assert sum(t.nbytes for pair in engine.pool.layers.values() for t in pair) <= budget
        assert engine.stats()["preemptions"] > 0
        assert engine.pool.free_blocks == engine.pool.num_blocks  # every block came back
    finally:
        engine.close()
    assert out == expected


def _bytes_for_blocks(path, block_size, blocks):
    engine = build_offload_engine(path, block_size=block_size, max_num_seqs=1, max_model_len=block_size)
    per_token = engine.kv_bytes_per_token
    engine.close()
    return per_token * block_size * blocks


def test_a_request_beyond_what_the_kv_budget_holds_is_refused_naming_the_limit(checkpoints):
    path = checkpoints("qwen3_moe")
    engine = build_offload_engine(path, block_size=4, kv_cache_memory=_bytes_for_blocks(path, 4, 8))
    try:
        assert engine.info.max_model_len == 32  # capped from the model's 256 to the 8 blocks of 4 the budget holds
        with pytest.raises(ConfigError, match="maximum context length is 32 tokens"):
            engine.start(list(range(1, 20)), SamplingParams(max_tokens=20))
        assert len(list(engine.generate(list(range(1, 20)), SamplingParams(max_tokens=13, ignore_eos=True)))) == 13
    finally:
        engine.close()


def test_kv_memory_grows_with_the_sequences(checkpoints):
    """Blocks are handed out as tokens arrive: a short request uses a few blocks of a large pool, and returns them."""
    engine = build_offload_engine(checkpoints("qwen3_moe"), block_size=4)
    try:
        gen = engine.start([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
        engine.step()
        assert engine.load() == {"running": 1, "waiting": 0, "kv_usage": pytest.approx(2 / engine.pool.num_blocks)}
        list(gen)
        assert engine.pool.free_blocks == engine.pool.num_blocks
    finally:
        engine.close()


def test_aborting_a_running_sequence_frees_it_and_the_rest_go_on(checkpoints):
    expected = references(checkpoints, "qwen3_moe")
    engine = build_offload_engine(checkpoints("qwen3_moe"))
    try:
        a = engine.start(PROMPTS[0], SamplingParams(max_tokens=LENGTHS[0], ignore_eos=True))
        b = engine.start(PROMPTS[1], SamplingParams(max_tokens=LENGTHS[1], ignore_eos=True))
        engine.step()
        engine.step()
        b.close()
        assert b.stats.finish_reason == "abort" and engine.load()["running"] == 1
        assert a.drain() + list(a) == expected[0]
    finally:
        engine.close()


def test_scheduler_options_are_checked_before_loading():
    with pytest.raises(ConfigError, match="max_num_seqs: expected an integer >= 1, got 0"):
        build_offload_engine("/nonexistent", max_num_seqs=0)
    with pytest.raises(ConfigError, match="kv_cache_memory: expected an integer >= 1"):
        build_offload_engine("/nonexistent", kv_cache_memory=-5)


@pytest.mark.parametrize("policy", ["static", "lru"])
def test_a_family_with_linear_attention_state_batches_paged(tmp_path, policy):
    """Qwen3-Next keeps gated-delta-rule state in its linear-attention layers: it runs paged, each sequence's conv
    window and recurrent state in a seat of the pool (model/deltanet.py), and batched sequences still get
    transformers' greedy tokens (fp32: the module's own code on each sequence's state), prefills chunked and mixed with
    other sequences' decode rows, a preempted sequence recomputed from a fresh state; the per-sequence path too."""
    import torch
    from offload_helpers import COMMON
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    cfg = Qwen3NextConfig(**COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2, linear_num_value_heads=2,
                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                          layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    path = str(tmp_path)
    model = stock(path)
    expected = [greedy(model, p, n)[0] for p, n in zip(PROMPTS, LENGTHS)]
    engine = build_offload_engine(path, policy=policy, fraction=0.5, max_num_seqs=3, max_num_batched_tokens=6)
    try:
        assert engine.paged
        # one linear-attention layer: conv window [2 * 2 * 8 + 2 * 8 channels, 4 taps] fp32 + state [2, 8, 8] fp32
        assert engine.state_bytes_per_seq == (48 * 4 + 2 * 8 * 8) * 4
        assert run_staggered(engine)[0] == expected
        assert not engine.pool.seats  # every seat came back
    finally:
        engine.close()
    # the attention layer's KV for 36 tokens (the third sequence is preempted) and the three seats' state
    budget = _bytes_for_blocks(path, 4, 9) + 3 * 1280
    engine = build_offload_engine(path, policy=policy, fraction=0.5, block_size=4, kv_cache_memory=budget,
                                  max_num_seqs=3, max_num_batched_tokens=16)
    try:
        assert engine.pool.num_blocks == 9
        assert run_staggered(engine)[0] == expected
        assert engine.stats()["preemptions"] > 0
    finally:
        engine.close()
    if policy == "lru":
        assert staggered_per_sequence(path, cache="dynamic") == expected
        with pytest.raises(ConfigError, match="do not hold the linear-attention state of max_num_seqs=3"):
            build_offload_engine(path, max_num_seqs=3, max_num_batched_tokens=6, kv_cache_memory=3 * 1024)


def test_prompt_logprobs_are_the_same_when_the_prompt_is_prefilled_in_chunks(checkpoints):
    """Prompt logprobs come from every prefill chunk's positions: chunks of 4 tokens, batched with another
    sequence, give the entries one whole-prompt prefill gives (fp32: equal to rounding)."""
    path = checkpoints("qwen3_moe")
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    whole = build_offload_engine(path)
    chunked = build_offload_engine(path, max_num_batched_tokens=4, max_num_seqs=2)
    try:
        a = whole.generate(PROMPTS[2], params)
        ref = list(a)
        other = chunked.start(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        b = chunked.start(PROMPTS[2], params)
        assert list(b) == ref and list(other)
    finally:
        whole.close()
        chunked.close()
    assert len(b.prompt_logprobs) == len(PROMPTS[2]) and b.prompt_logprobs[0] is None
    for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs):
        assert (x.token, x.rank, [t for t, _ in x.top]) == (y.token, y.rank, [t for t, _ in y.top])
        assert abs(x.logprob - y.logprob) < 1e-4


def test_a_window_kept_on_the_attention_module_is_applied(tmp_path):
    # Qwen2-MoE with use_sliding_window passes no sliding_window to the attention function (its mask applies the
    # window, the module keeps it as an attribute): the paged path must find it there, or long prompts attend to
    # keys transformers masks out
    import torch
    from offload_helpers import COMMON
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(1234)
    cfg = Qwen2MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         use_sliding_window=True, sliding_window=4, max_window_layers=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    path = str(tmp_path / "m")
    expected = [greedy(stock(path), p, n)[0] for p, n in zip(PROMPTS, LENGTHS)]
    engine = build_offload_engine(path, max_num_batched_tokens=16)
    try:
        assert any(getattr(layer.self_attn, "sliding_window", None) == 4 for layer in engine.model.model.layers)
        out, _ = run_staggered(engine)
    finally:
        engine.close()
    assert out == expected
