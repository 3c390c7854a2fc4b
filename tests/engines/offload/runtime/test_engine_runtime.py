"""OffloadEngine: greedy equals stock transformers, sampling, stops, input errors, stats that add up.

Models: the demo model (built once per session) and a tiny random qwen3_moe / mixtral from offload_helpers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams
from moe_offload.errors import ConfigError, ModelError, PlacementError

N = 16  # greedy tokens compared against stock generate()


@pytest.fixture(scope="session")
def demo_dir(demo_model_dir):
    return str(demo_model_dir)


@pytest.fixture(scope="module")
def demo_engine(demo_dir):
    engine = build_offload_engine(demo_dir, policy="static", fraction=0.25)
    yield engine
    engine.close()


def stock_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(engine, prompt, **kw):
    gen = engine.generate(prompt, SamplingParams(**kw))
    return list(gen), gen.stats


PROMPT = [5, 17, 42, 9, 100, 3, 77, 21]


@pytest.mark.parametrize(
    "model,policy,fraction",
    [
        ("demo", "static", 1.0),
        ("demo", "static", 0.25),
        ("demo", "lru", 0.5),
        ("demo", "hybrid", 0.0),
        ("qwen3_moe", "static", 0.0),
        ("qwen3_moe", "lru", 0.25),
        ("mixtral", "hybrid", 0.5),
        ("gpt_oss", "static", 0.5),  # sliding-window layers in the static KV cache
        ("deepseek_v3", "lru", 0.5),  # MLA attention, a dense first layer
    ],
)
def test_greedy_equals_stock_generate(model, policy, fraction, demo_dir, checkpoints):
    path = demo_dir if model == "demo" else checkpoints(model)
    expected = stock_greedy(path, PROMPT, N)
    engine = build_offload_engine(path, policy=policy, fraction=fraction)
    try:
        tokens, stats = run(engine, PROMPT, max_tokens=N, ignore_eos=True)
    finally:
        engine.close()
    assert tokens == expected
    assert stats.finish_reason == "length" and stats.completion_tokens == N


def test_dynamic_cache_gives_the_same_tokens(checkpoints):
    path = checkpoints("qwen3_moe")
    out = {}
    for cache in ("paged", "dynamic"):
        engine = build_offload_engine(path, cache=cache)
        out[cache] = run(engine, PROMPT, max_tokens=N, ignore_eos=True)[0]
        engine.close()
    assert out["paged"] == out["dynamic"]


def test_seeded_sampling_is_reproducible_and_seeds_differ(demo_engine):
    def sample(seed):
        return run(demo_engine, PROMPT, max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)[0]

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    # A random-weight model has nearly flat logits over 1024 tokens: two seeds agreeing on 12 tokens is ~impossible.
    assert a != c


def test_top_k_1_and_tiny_top_p_are_greedy(demo_engine):
    greedy = run(demo_engine, PROMPT, max_tokens=8, ignore_eos=True)[0]
    assert run(demo_engine, PROMPT, max_tokens=8, temperature=1.5, top_k=1, seed=1, ignore_eos=True)[0] == greedy
    assert run(demo_engine, PROMPT, max_tokens=8, temperature=1.5, top_p=1e-6, seed=1, ignore_eos=True)[0] == greedy


def test_extreme_seeds_sample(demo_engine):
    # torch.Generator.manual_seed takes -2**63..2**64-1; SamplingParams refuses what lies outside
    for seed in (2**64 - 1, -(2**63)):
        assert len(run(demo_engine, PROMPT, max_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)[0]) == 2


def test_stop_token_ids_end_the_request_without_the_stop_token(demo_engine):
    full, _ = run(demo_engine, PROMPT, max_tokens=N, ignore_eos=True)
    stop = full[5]
    tokens, stats = run(demo_engine, PROMPT, max_tokens=N, ignore_eos=True, stop_token_ids=(stop,))
    assert tokens == full[: full.index(stop)]
    assert stats.finish_reason == "stop"


def test_eos_is_honoured_unless_ignored(checkpoints):
    engine = build_offload_engine(checkpoints("qwen3_moe"))
    try:
        full, _ = run(engine, PROMPT, max_tokens=N, ignore_eos=True)
        eos = full[3]
        engine.info = dataclasses.replace(engine.info, eos_token_ids=(eos,))
        tokens, stats = run(engine, PROMPT, max_tokens=N)
        assert tokens == full[: full.index(eos)] and stats.finish_reason == "stop"
        tokens, stats = run(engine, PROMPT, max_tokens=N, ignore_eos=True)
        assert tokens == full and stats.finish_reason == "length"
    finally:
        engine.close()


def test_demo_engine_knows_its_eos_and_context(demo_engine):
    assert set(demo_engine.info.eos_token_ids) >= {demo_engine.tokenizer.eos_token_id}
    assert demo_engine.info.max_model_len == 2048 and demo_engine.info.vocab_size == 1024


def test_prompt_errors(demo_engine):
    with pytest.raises(ConfigError, match="maximum context length is 2048"):
        demo_engine.generate([1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(ConfigError, match=r"0\.\.1023, got 1024"):
        demo_engine.generate([1, 1024], SamplingParams())
    with pytest.raises(ConfigError, match="empty prompt"):
        demo_engine.generate([], SamplingParams())


@pytest.mark.parametrize("policy,fraction", [("static", 0.0), ("static", 0.25), ("lru", 0.25), ("hybrid", 0.5)])
def test_stats_add_up(policy, fraction, checkpoints):
    from transformers import AutoConfig

    path = checkpoints("qwen3_moe")
    cfg = AutoConfig.from_pretrained(path)
    engine = build_offload_engine(path, policy=policy, fraction=fraction)
    try:
        tokens, s = run(engine, PROMPT, max_tokens=10, ignore_eos=True)
        # the last sampled token is never fed back, so the model read prompt + completion - 1 tokens
        routed = (len(PROMPT) + len(tokens) - 1) * cfg.num_hidden_layers * cfg.num_experts_per_tok
        assert s.hits + s.misses == routed
        assert s.prompt_tokens == len(PROMPT) and s.completion_tokens == len(tokens) == 10
        assert len(s.token_ms) == 9 and s.prefill_ms > 0 and s.decode_ms == pytest.approx(sum(s.token_ms))
        assert sum(s.hit_rate_by_tier.values()) == pytest.approx(1.0)
        assert s.hit_rate == pytest.approx(s.hits / routed)
        assert set(s.stage_ms) >= {"router", "device_experts", "host_experts", "fetch", "other"}
        if policy == "static":
            assert s.host_expert_tokens == s.misses and sum(s.bytes_moved.values()) == 0
        if policy == "static" and fraction == 0:
            assert s.hits == 0
        if policy == "lru":
            state = engine.executor.layers[0]
            assert s.host_expert_tokens == 0 and s.misses > 0
            assert sum(s.bytes_moved.values()) % state.expert_bytes == 0 and sum(s.bytes_moved.values()) > 0
        # cumulative = sum of requests
        _, s2 = run(engine, PROMPT[:4], max_tokens=3, ignore_eos=True)
        total = engine.stats()
        assert total["hits"] == s.hits + s2.hits and total["misses"] == s.misses + s2.misses
        assert total["completion_tokens"] == 13 and total["host_expert_tokens"] == s.host_expert_tokens + s2.host_expert_tokens
        assert json.loads(json.dumps(total)) == total
    finally:
        engine.close()


def test_closing_a_generation_aborts_and_counts(demo_engine):
    before = demo_engine.stats()["completion_tokens"]
    gen = demo_engine.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))
    first = [next(gen), next(gen)]
    gen.close()
    assert len(first) == 2 and gen.stats.finish_reason == "abort"
    assert demo_engine.stats()["completion_tokens"] == before + 2


def test_build_options_are_checked(demo_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown engine option.*valid: device, backend, policy, fraction"):
        build_offload_engine(demo_dir, slots=3)
    with pytest.raises(ConfigError, match="policy"):
        build_offload_engine(demo_dir, policy="fifo")
    with pytest.raises(ConfigError, match="fraction"):
        build_offload_engine(demo_dir, fraction=1.5)
    with pytest.raises(ConfigError, match="either a placement or a fraction"):
        build_offload_engine(demo_dir, str(tmp_path / "p.json"), fraction=0.5)
    with pytest.raises(ModelError, match="not a directory"):
        build_offload_engine(str(tmp_path / "nothing"))


def test_placement_of_another_model_is_refused(demo_dir, checkpoints, tmp_path):
    from moe_offload.backends import get_backend
    from moe_offload.control import placement
    from moe_offload.control.spec import ModelSpec

    other = placement.from_fraction(ModelSpec.from_hf_config(checkpoints("qwen3_moe")), get_backend("cpu").tiers(), 0.5)
    file = tmp_path / "other.json"
    file.write_text(other.to_json())
    with pytest.raises(PlacementError):
        build_offload_engine(demo_dir, str(file))


def test_a_torch_failure_fails_the_request_not_the_engine(checkpoints):
    from moe_offload.errors import EngineError

    engine = build_offload_engine(checkpoints("qwen3_moe"))
    try:
        real = engine.runner.forward_paged

        def broken(sched):
            if all(n == 1 for _, n in sched.scheduled):  # decode steps fail, the prefill works
                raise RuntimeError("simulated kernel failure")
            return real(sched)

        engine.runner.forward_paged = broken
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        assert next(gen) >= 0
        with pytest.raises(EngineError, match="after 1 tokens: simulated kernel failure"):
            next(gen)
        engine.runner.forward_paged = real
        assert len(run(engine, PROMPT, max_tokens=3, ignore_eos=True)[0]) == 3
    finally:
        engine.close()
