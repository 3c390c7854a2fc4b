"""engines/offload/runtime/sampling.py against plain references written here, and the engine's logprobs against
transformers' own logits (tiny qwen3_moe checkpoint and the demo model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_offload.engines.offload.runtime.sampling import SequenceState, prompt_logprobs, sample
from moe_offload.engines.params import SamplingParams, StructuredOutput

V = 8


def state(prompt=(0,), eos=(7,), **kw) -> SequenceState:
    return SequenceState(SamplingParams(max_tokens=64, **kw), list(prompt), vocab_size=V, eos_ids=eos)


def pick(logits, **kw):
    return sample(logits.unsqueeze(0), [state(**kw)])[0][0]


def test_filters_top_k_top_p_min_p_and_greedy():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, -1.0, 2.0, -3.0, -3.0])
    s = state(temperature=1.0, top_k=2, seed=0)
    assert {sample(logits.unsqueeze(0), [s])[0][0] for _ in range(200)} == {1, 2}
    # probs [.5, .3, .2]: top_p .6 keeps the first two (the mass before the third is .8 >= .6)
    probs = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0]).log()
    s = state(temperature=1.0, top_p=0.6, seed=0)
    assert {sample(probs.unsqueeze(0), [s])[0][0] for _ in range(300)} == {0, 1}
    # min_p .5 keeps tokens with at least half the top probability: .5 and .3 (.3 >= .25), not .2 (< .25)
    s = state(temperature=1.0, min_p=0.5, seed=0)
    assert {sample(probs.unsqueeze(0), [s])[0][0] for _ in range(300)} == {0, 1}
    assert pick(logits) == 1
    # a temperature that passes the API but overflows float32 logits / T: greedy, not NaN
    assert pick(logits.bfloat16() * 10, temperature=1e-40) == 1


def test_draws_follow_the_distribution_and_seeds_repeat():
    probs = torch.tensor([0.1, 0.6, 0.3, 0, 0, 0, 0, 0])
    s = state(temperature=1.0, seed=3)
    draws = [sample(probs.log().unsqueeze(0), [s])[0][0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=V).float() / len(draws)
    # 3000 draws: the standard error of each frequency is below 0.01; 0.04 is 4+ sigma
    torch.testing.assert_close(freq, probs, atol=0.04, rtol=0)
    again = state(temperature=1.0, seed=3)
    assert [sample(probs.log().unsqueeze(0), [again])[0][0] for _ in range(3000)] == draws


def reference_process(logits, params: SamplingParams, prompt, output, eos):
    """vLLM's order, one token id at a time."""
    x = [float(v) for v in logits]
    if len(output) < params.min_tokens:
        for t in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)):
            x[t] = -math.inf
    for t, b in params.logit_bias:
        x[t] += b
    for t in range(len(x)):
        if params.repetition_penalty != 1 and (t in prompt or t in output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        c = output.count(t)
        x[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return x


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, frequency_penalty=0.5),
    dict(presence_penalty=1.5, frequency_penalty=-0.5),
    dict(logit_bias=((2, 10.0), (1, -100.0)), min_tokens=3),
    dict(min_tokens=2, stop_token_ids=(5,), presence_penalty=0.2),
])
def test_penalties_bias_and_min_tokens_match_a_plain_reference(kw):
    g = torch.Generator().manual_seed(0)
    prompt, eos = [1, 3, 3], (7,)
    s = state(prompt=prompt, eos=eos, **kw)
    output: list[int] = []
    for _ in range(6):
        logits = torch.randn(V, generator=g) * 3
        ref = reference_process(logits, s.params, prompt, output, eos)
        token = sample(logits.unsqueeze(0), [s])[0][0]
        assert token == max(range(V), key=ref.__getitem__), (kw, output)
        s.accept(token)
        output.append(token)


def test_a_batch_equals_its_rows_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 2
    kws = [dict(), dict(temperature=0.8, seed=5, top_k=3), dict(temperature=1.2, seed=9, top_p=0.7, repetition_penalty=1.2),
           dict(presence_penalty=1.0, logprobs=2)]
    batch = [state(**kw) for kw in kws]
    alone = [state(**kw) for kw in kws]
    for _ in range(5):
        got = sample(logits, batch)
        for b, s in enumerate(alone):
            assert got[b] == sample(logits[b:b + 1], [s])[0]
            batch[b].accept(got[b][0])
            s.accept(got[b][0])


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(V, generator=g) * 4).bfloat16()
    s = state(temperature=0.5, seed=1, logprobs=3, repetition_penalty=1.5, logit_bias=((0, 5.0),))
    token, entry = sample(logits.unsqueeze(0), [s])[0]
    ref = torch.log_softmax(logits.float(), dim=-1)  # before bias, penalty and temperature
    assert entry.token == token and entry.logprob == float(ref[token])  # bitwise: the same fp32 op
    assert entry.rank == 1 + int((ref > ref[token]).sum())
    values, ids = torch.topk(ref, 3)
    assert entry.top == tuple(zip(ids.tolist(), values.tolist()))
    assert sample(logits.unsqueeze(0), [state(logprobs=0)])[0][1].top == ()


def test_prompt_logprobs_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    prompt = [4, 1, 0, 6, 2]
    out = prompt_logprobs(logits, prompt, 2)
    assert out[0] is None and len(out) == 5
    lp = torch.log_softmax(logits, dim=-1)
    for t in range(1, 5):
        assert out[t].token == prompt[t] and out[t].logprob == pytest.approx(float(lp[t - 1, prompt[t]]), abs=0)
        assert [i for i, _ in out[t].top] == torch.topk(lp[t - 1], 2).indices.tolist()


def test_sampling_params_validate_new_fields():
    from moe_offload.errors import ConfigError

    for bad, field in [(dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
                       (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_tokens=20), "min_tokens"),
                       (dict(logprobs=21), "logprobs"), (dict(logit_bias={"x": 1}), "logit_bias"),
                       (dict(logit_bias={3: 200}), "logit_bias"), (dict(structured={"kind": "xml"}), "structured")]:
        with pytest.raises(ConfigError, match=field.split("_")[0] if field == "structured" else field):
            SamplingParams(max_tokens=16, **bad)
    p = SamplingParams(logit_bias={"3": 1.5}, structured={"kind": "regex", "spec": "a+"})
    assert p.logit_bias == ((3, 1.5),) and p.structured == StructuredOutput("regex", "a+")
    assert p.features() == ("logit_bias", "structured")
    assert SamplingParams(**p.to_wire()) == p  # the engine protocol's JSON round-trips


# -- the engine: logprobs against transformers, structured output on the demo tokenizer ---------------------
def test_engine_logprobs_match_transformers(checkpoints):
    from offload_helpers import greedy, stock

    from moe_offload.engines.offload.runtime.build import build_offload_engine

    path = checkpoints("qwen3_moe")
    prompt = [3, 17, 42, 9, 88, 5, 61, 23]
    model = stock(path)
    tokens_ref, logits_ref = greedy(model, prompt, 6)  # fp32 logits [6, V] of each generated position
    with torch.inference_mode():
        prompt_ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [T, V]
    engine = build_offload_engine(path, policy="static", fraction=0.5)
    try:
        gen = engine.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3))
        tokens = list(gen)
    finally:
        engine.close()
    assert tokens == tokens_ref
    ref = torch.log_softmax(logits_ref, dim=-1)
    # The executor's expert GEMMs agree with stock transformers' grouped_mm to fp32 rounding (test_exactness.py),
    # so the logprobs do too: 1e-5 absolute, the bound test_exactness uses for the logits themselves.
    for i, e in enumerate(gen.logprobs):
        assert e.token == tokens[i] and e.rank == 1  # greedy picks the most likely token
        assert e.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        assert [t for t, _ in e.top] == torch.topk(ref[i], 5).indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(torch.topk(ref[i], 5).values.tolist(), abs=1e-5)
    assert gen.prompt_logprobs[0] is None and len(gen.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        assert gen.prompt_logprobs[t].logprob == pytest.approx(float(prompt_ref[t - 1, prompt[t]]), abs=1e-5)


@pytest.fixture(scope="module")
def demo_engine(demo_model_dir):
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    engine = build_offload_engine(str(demo_model_dir), policy="static", fraction=0.5)
    yield engine
    engine.close()


def test_engine_structured_output_parses_and_validates(demo_engine):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "tag": {"enum": ["river", "expert"]}, "ok": {"type": "boolean"}},
              "required": ["n", "tag", "ok"], "additionalProperties": False}
    prompt = demo_engine.tokenizer.encode("The river runs", add_special_tokens=False)
    for seed in (0, 1, 2):
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured=StructuredOutput("json", json.dumps(schema)))
        gen = demo_engine.generate(prompt, params)
        text = demo_engine.tokenizer.decode(list(gen))
        # random weights: without the mask this would never be JSON; with it the grammar ends the output
        assert gen.stats.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    gen = demo_engine.generate(prompt, SamplingParams(max_tokens=8, structured=StructuredOutput("choice", '["yes", "no"]')))
    assert demo_engine.tokenizer.decode(list(gen)) in ("yes", "no")
