"""The mock engine: deterministic, honest stats in the real engines' shape."""

import pytest

from moe_offload.engines.base import GenerationStats
from moe_offload.engines.mock import MockConfig, MockEngine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError


def run(engine, prompt, **kw):
    gen = engine.generate(prompt, SamplingParams(**kw))
    return list(gen), gen.stats


def test_same_prompt_and_seed_same_tokens():
    e = MockEngine(MockConfig(ms_per_token=0))
    a, _ = run(e, [5, 6, 7], max_tokens=12, temperature=0.9, seed=1)
    b, _ = run(e, [5, 6, 7], max_tokens=12, temperature=0.9, seed=1)
    c, _ = run(e, [5, 6, 7], max_tokens=12, temperature=0.9, seed=2)
    assert a == b
    assert a != c  # 12 sampled bytes from different seeds coincide with negligible probability


def test_stats_shape_and_hit_rate():
    e = MockEngine(MockConfig(ms_per_token=1, hit_rate=0.75, layers=2, top_k=4))
    tokens, stats = run(e, [1, 2], max_tokens=9, ignore_eos=True)
    assert len(tokens) == 9 == stats.completion_tokens
    assert len(stats.token_ms) == 8
    assert stats.decode_ms >= 8 * 1.0  # the sleep is real
    # 2 prompt + 8 decoded tokens route through 2 layers x top-4.
    assert stats.hits + stats.misses == (2 + 8) * 2 * 4
    assert stats.hits == 60 and stats.misses == 20
    assert stats.hit_rate_by_tier == {"mock:0": 0.75}
    assert stats.host_expert_tokens == stats.misses
    d = stats.to_dict()
    assert set(d) >= {"decode_ms_per_token", "prefill_ms", "hit_rate_by_tier", "bytes_moved", "stage_ms"}
    assert e.stats()["completion_tokens"] == 9


def test_lru_policy_reports_bytes_moved():
    e = MockEngine(MockConfig(ms_per_token=0, hit_rate=0.5, policy="lru"))
    _, stats = run(e, [1], max_tokens=4)
    assert stats.bytes_moved["mock:0"] == stats.misses * e.config.expert_bytes


def test_stop_token_and_close():
    e = MockEngine(MockConfig(ms_per_token=0))
    first, _ = run(e, [1, 2, 3], max_tokens=3)
    _, stats = run(e, [1, 2, 3], max_tokens=10, stop_token_ids=(first[1],))
    assert stats.finish_reason == "stop" and stats.completion_tokens == 1
    gen = e.generate([1, 2, 3], SamplingParams(max_tokens=50))
    next(gen)
    gen.close()
    assert gen.stats.finish_reason == "abort"
    assert list(gen) == []


@pytest.mark.parametrize(
    "prompt, kw, match",
    [
        ([], {}, "empty prompt"),
        ([9999], {}, "prompt token id"),
        ([1] * 4000, {"max_tokens": 200}, "maximum context length"),
    ],
)
def test_bad_requests(prompt, kw, match):
    with pytest.raises(ConfigError, match=match):
        MockEngine().generate(prompt, SamplingParams(**kw))


# seed beyond 64 bits: torch.Generator.manual_seed raises ValueError inside the engine thread (an engine "crash")
@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"seed": "x"},
                                {"seed": 2**64}, {"seed": -(2**63) - 1}])
def test_bad_sampling_params(kw):
    with pytest.raises(ConfigError):
        SamplingParams(**kw)


def test_seed_range_edges_are_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_tiny_temperature_is_greedy():
    # 1e-30 passes the API's 0..2 range; dividing logits by it overflows to inf and softmax gives NaN
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=0.01).greedy
    e = MockEngine(MockConfig(ms_per_token=0))
    greedy = list(e.generate([1, 2, 3], SamplingParams(max_tokens=5, seed=3)))  # the mock's logits depend on the seed
    assert list(e.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=1e-300, seed=3))) == greedy


def test_stats_defaults_are_zero():
    s = GenerationStats()
    assert s.hit_rate == 0.0 and s.decode_ms_per_token == 0.0


def test_cumulative_stats_sum_every_key_and_stay_bounded():
    # Engine.stats() is "the same keys as GenerationStats.to_dict, summed"; a long-running server must not
    # keep every step time it ever measured.
    e = MockEngine(MockConfig(ms_per_token=0))
    runs = []
    for i in range(12):
        gen = e.generate([1, 2, 3, i], SamplingParams(max_tokens=200, ignore_eos=True))
        list(gen)
        runs.append(gen.stats)
    total = e.stats()
    assert total["completion_tokens"] == sum(s.completion_tokens for s in runs)
    assert total["stage_ms"]["experts"] == pytest.approx(sum(s.stage_ms["experts"] for s in runs), abs=1e-2)
    assert len(e._total.token_ms) <= 1024
    steps = sum(len(s.token_ms) for s in runs)
    assert steps > 1024  # so the window has dropped some, and the mean below must still count them
    assert total["decode_ms_per_token"] == pytest.approx(sum(s.decode_ms for s in runs) / steps, abs=1e-3)
