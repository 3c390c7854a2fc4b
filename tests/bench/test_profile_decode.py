"""bench/profile_decode.py's bookkeeping on the demo model: the stages add up to each step, the stages that must
run do, and the profiler leaves the engine as it found it (no hooks, sampling unpatched)."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def profile_decode():
    sys.path.insert(0, str(BENCH))
    try:
        import profile_decode

        yield profile_decode
    finally:
        sys.path.remove(str(BENCH))


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_stages_add_up_to_the_step(profile_decode, demo_model_dir):
    import moe_offload.engines.offload.runtime.output as output_module
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    engine = build_offload_engine(demo_model_dir, policy="static", fraction=0.5, dtype="bfloat16")
    try:
        sample = output_module.sample
        hooks = _hooks(engine.model)
        stages = profile_decode.stage_map(engine.model)
        kinds = set(stages.values())
        # the demo model (qwen3_moe) has every role but shared experts and dense MLPs
        assert {"embedding", "attention", "norms", "router", "experts", "LM head", "rotary embedding"} <= kinds
        r = profile_decode.profile(engine, list(range(3, 11)), 5)
        assert r["steps"] == 5 and r["sampling_timed"]
        for step in r["per_step"]:
            # exclusive times of the hooked tree sum to the forward; the loop is the rest: so they sum to the step
            total = sum(step.get(s, 0.0) for s in profile_decode.STAGES)
            assert total == pytest.approx(step["_step"], rel=1e-6, abs=1e-9)
            assert step["engine loop"] >= -1e-6
        for s in ("attention", "router", "experts", "LM head", "sampling"):
            assert r["median"][s] > 0, s
        # half the experts resident: the executor computes misses on the host, and says so
        assert r["executor_split"].get("host_experts", 0) > 0
        assert output_module.sample is sample and _hooks(engine.model) == hooks
    finally:
        engine.close()
