"""Speculative decoding is exact: greedy tokens are the plain run's (transformers' in fp32) for every family, solo and
batched, on the module path and the fused decode path; sampling keeps the target distribution (rejection sampling).

Why these could fail: a verify step computes k + 1 tokens of a sequence in one forward, so a wrong position, a KV row
of a rejected draft read by a later step, a row kept for the wrong token or an off-by-one in how many tokens the step
keeps changes the output; the fused path takes the draft as extra rows of one step, which is only right if every row's
KV is written before any row attends.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import FAMILIES, greedy, staggered, stock
from offload_helpers import references as shared_references

from moe_offload.engines.offload.runtime import speculative
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.offload.runtime.sampling import SequenceState
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61])
LENGTHS = (20, 7, 15)


def references(checkpoints, family):
    return shared_references(checkpoints(family), PROMPTS, LENGTHS)


class Oracle:
    """Drafts the reference continuation with one token wrong at a position that moves every step (and, every
    fourth step, none wrong): verify steps then accept 0..k drafts, take the bonus, and reject at every position."""

    def __init__(self, prompts, refs, vocab=128):
        self.cont = {tuple(p): r for p, r in zip(prompts, refs)}
        self.vocab, self.calls = vocab, 0

    def propose(self, sid, tokens, k):
        self.calls += 1
        for p, ref in self.cont.items():
            if tuple(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                draft = list(ref[done : done + k])
                bad = self.calls % (k + 1)
                if bad < len(draft):
                    draft[bad] = (draft[bad] + 1) % self.vocab
                return draft
        return []

    def release(self, sid):
        pass


def run_all(engine):
    """The first two start together, the third joins after two steps; each one's tokens."""
    return staggered(engine, PROMPTS, LENGTHS)


def oracle_run(path, expected, speculative, **options):
    """run_all on an engine whose drafts come from Oracle(expected)."""
    engine = build_offload_engine(path, max_num_batched_tokens=16, speculative=speculative, **options)
    try:
        engine.proposer = Oracle(PROMPTS, expected)
        return run_all(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["static", "lru", "hybrid"])
def test_greedy_tokens_with_drafts_are_transformers_tokens(checkpoints, family, policy):
    expected = references(checkpoints, family)
    out, gens = oracle_run(checkpoints(family), expected, {"num_speculative_tokens": 3, "disable_by_batch_size": None},
                           policy=policy, fraction=0.5)
    assert out == expected
    for g, n in zip(gens, LENGTHS):
        s = g.stats
        assert s.completion_tokens == n and s.finish_reason == "length"
        assert s.spec_drafts > 0 and 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # accepted and rejected both


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_prompt_lookup_keeps_the_plain_runs_tokens(checkpoints, family):
    """The n-gram proposer end to end (its drafts, not an oracle's), solo, on a prompt that repeats itself."""
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    ref = greedy(stock(checkpoints(family)), prompt, 24)[0]
    engine = build_offload_engine(checkpoints(family), speculative='{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        g = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        assert list(g) == ref
        assert g.stats.spec_drafts > 0 and g.stats.spec_accepted_tokens > 0  # the prompt's repeat was drafted
        assert engine.stats()["speculative"]["method"] == "ngram"
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_fused_decode_path_verifies_a_draft_as_rows_of_one_step(checkpoints, family):
    """bf16, every expert resident: the fused path (the whole-step call) takes verify steps, and its tokens are the
    plain bf16 run's, solo and batched."""
    plain = build_offload_engine(checkpoints(family), dtype="bfloat16", max_num_batched_tokens=16)
    try:
        expected, _ = run_all(plain)
    finally:
        plain.close()
    engine = build_offload_engine(checkpoints(family), dtype="bfloat16", max_num_batched_tokens=16,
                                  speculative={"num_speculative_tokens": 3, "disable_by_batch_size": None})
    try:
        assert engine.runner.fast is not None
        engine.proposer = Oracle(PROMPTS, expected)
        steps = engine.runner.fast.steps
        out, gens = run_all(engine)
        assert engine.runner.fast.steps > steps  # verify steps ran on the fused path
    finally:
        engine.close()
    assert out == expected
    assert all(g.stats.spec_accepted_tokens > 0 for g in gens)


def test_a_request_can_turn_speculation_off_and_max_tokens_holds(checkpoints):
    expected = references(checkpoints, "qwen3_moe")
    engine = build_offload_engine(checkpoints("qwen3_moe"), speculative={"num_speculative_tokens": 5})
    try:
        engine.proposer = Oracle(PROMPTS, expected)
        off = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
        assert list(off) == expected[0] and off.stats.spec_drafts == 0
        for n in (1, 2, 6):  # a draft never runs past max_tokens
            g = engine.generate(PROMPTS[0], SamplingParams(max_tokens=n, ignore_eos=True))
            assert list(g) == expected[0][:n] and g.stats.finish_reason == "length"
    finally:
        engine.close()


def test_no_drafts_from_the_batch_size_that_disables_them(checkpoints):
    expected = references(checkpoints, "qwen3_moe")
    out, gens = oracle_run(checkpoints("qwen3_moe"), expected, {"num_speculative_tokens": 3, "disable_by_batch_size": 2})
    assert out == expected
    # the second prompt (7 tokens) finishes while the others decode: only the one left alone at the end drafts
    assert gens[1].stats.spec_drafts == 0 and gens[0].stats.spec_drafts > 0


def test_a_stop_token_inside_an_accepted_draft_ends_the_sequence_there(checkpoints):
    expected = references(checkpoints, "qwen3_moe")[0]
    stop = expected[5]
    first = expected.index(stop)
    engine = build_offload_engine(checkpoints("qwen3_moe"), speculative={"num_speculative_tokens": 8})
    try:
        engine.proposer = Oracle(PROMPTS, references(checkpoints, "qwen3_moe"))
        g = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, stop_token_ids=(stop,)))
        assert list(g) == expected[:first] and g.stats.finish_reason == "stop"
    finally:
        engine.close()


def test_rejection_sampling_draws_from_the_target_distribution():
    """Whatever the draft, the kept first token is distributed as the target's (filtered) distribution."""
    torch.manual_seed(0)
    V, n = 12, 40000
    logits = torch.randn(3, V) * 1.5  # rows: after the last token, after draft 1, after draft 2
    params = SamplingParams(temperature=0.8, top_k=8, seed=3, max_tokens=4)
    state = SequenceState(params, [1, 2], vocab_size=V)
    target = speculative._filter_probs(logits[:1], state)[0]  # what plain sampling draws from
    for draft in ([int(target.argmax()), 4], [int(target.argmin()), 4]):  # a likely draft and one never drawn
        counts = torch.zeros(V)
        for _ in range(n):
            tokens, _ = speculative.verify(logits, draft, state)
            counts[tokens[0]] += 1
        assert (counts / n - target).abs().max() < 0.012, (counts / n, target)


def test_greedy_verify_keeps_the_agreeing_prefix_and_one_more():
    logits = torch.full((4, 6), -5.0)
    for i, t in enumerate([2, 3, 1, 4]):
        logits[i, t] = 5.0
    state = SequenceState(SamplingParams(max_tokens=9), [0], vocab_size=6)
    assert speculative.verify(logits, [2, 3, 1], state)[0] == [2, 3, 1, 4]  # all accepted, then the bonus
    assert speculative.verify(logits, [2, 0, 1], state)[0] == [2, 3]  # the correction at the first miss
    assert speculative.verify(logits, [5, 3, 1], state)[0] == [2]


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    p = speculative.NgramProposer(speculative.SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    assert p.propose(0, [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # "2 3" latest before the end: 7 8 5
    assert p.propose(0, [1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # the 3-gram "1 2 3"
    assert p.propose(0, [1, 2, 3, 4], 2) == []


@pytest.mark.parametrize("bad, match", [
    ('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ("{nope", "JSON"), ('{"method": "draft_model"}', "model"), ('{"k": 3}', "unknown key"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup")])
def test_a_bad_speculative_config_is_refused_before_loading(bad, match):
    with pytest.raises(ConfigError, match=match):
        build_offload_engine("/nonexistent", speculative=bad)


def test_a_model_with_recurrent_state_refuses_speculation(tmp_path):
    from offload_helpers import build_qwen3_next

    path = build_qwen3_next(tmp_path / "next")
    with pytest.raises(ConfigError, match="rolled out"):
        build_offload_engine(path, speculative={"num_speculative_tokens": 2})


def test_a_draft_model_drafts_and_the_output_is_unchanged(checkpoints, tmp_path):
    """A draft model (here the target's own weights in fp32, so most drafts are accepted) through the draft_model
    proposer: its cache is cut back after rejections and kept per sequence."""
    path = checkpoints("qwen3_moe")
    expected = references(checkpoints, "qwen3_moe")
    engine = build_offload_engine(path, max_num_batched_tokens=16, speculative={"model": path, "num_speculative_tokens": 3,
                                                                               "disable_by_batch_size": None})
    try:
        out, gens = run_all(engine)
        assert not engine.proposer.seqs  # every finished sequence's draft cache was freed
    finally:
        engine.close()
    assert out == expected
    assert sum(g.stats.spec_accepted_tokens for g in gens) > 0
