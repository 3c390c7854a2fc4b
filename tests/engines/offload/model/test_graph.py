"""The owned model graph (model/graph.py, blocks.py) against transformers' modules, step by step.

Every step of a run (prefill chunks of three prompts mixed with decode rows, one prompt asking for its prompt
logprobs) is computed by the graph, then by the modules from the same KV state (the modules last: the trajectory
is theirs); the rows each kept are compared. fp32: the graph computes the modules' ops in their order, so the
logits are equal bit for bit (a gated-DeltaNet layer's recurrent states are restored between the two). bf16: the same, but where a row's attention goes through another SDPA call (the
graph's rows are laid out [N, heads, D], the modules' [1, heads, N, D]) a last-place difference is allowed.
Why it could fail: a rotary of the wrong kind or width, a q/k norm over the wrong span, a window off by one, a
router that renormalises when the family does not or rounds its weights when it keeps fp32, a shared expert's
gate left out, a KV row written where another sequence reads: each moves logits far beyond rounding.

Against what the project did not write: test_bf16_transformers.py and test_families.py run the engine, and so the
graph for every prefill step, against stock transformers.
"""

from __future__ import annotations

import families
import pytest
import torch

from moe_offload.control.description import describe
from moe_offload.control.families import FAMILIES
from moe_offload.engines.offload.model import graph
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams

HELPER_FAMILIES = ["gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]  # offload_helpers.py builds these
# registered families whose layers the graph's blocks do not yet express: transformers' modules run their steps
ON_THE_MODULES = {
    "qwen3_5_moe": "a vision-language wrapper: the text layers sit under model.language_model",
}
GRAPH_FAMILIES = sorted(set(FAMILIES) - set(ON_THE_MODULES))


def test_the_registry_is_split_between_the_graph_and_the_modules():
    # description-level refusals need no model; a family the graph takes gets as far as asking for the executor
    for family in FAMILIES:
        why = graph.refuse(None, None, describe(families.tiny_config(family)))
        assert why == ON_THE_MODULES.get(family, "no offload executor"), (family, why)
    assert set(GRAPH_FAMILIES) == set(FAMILIES) - set(ON_THE_MODULES)


def _compare(engine, max_steps: int = 80) -> list[tuple[float, bool]]:
    """Every step on both paths: (max |graph - modules| / max |modules| over the kept rows, decode-only step)."""
    runner, gaps = engine.runner, []
    g = runner.graph
    for _ in range(max_steps):
        sched = engine.scheduler.schedule()
        if sched.is_empty:
            break
        pool = engine.pool  # linear layers' per-sequence states: both paths step from the same ones
        with torch.inference_mode():
            before = {k: tuple(t.clone() for t in v) for k, v in pool.states.items()}
            ours = runner.forward_paged(sched)
            for k, v in before.items():
                for dst, src in zip(pool.states[k], v):
                    dst.copy_(src)
            runner.graph = None
            try:
                ref = runner.forward_paged(sched)
            finally:
                runner.graph = g
        if ref is None:
            assert ours is None
        else:
            assert ours.shape == ref.shape and ours.dtype == ref.dtype
            gaps.append((float((ours.float() - ref.float()).abs().max() / ref.float().abs().max()), sched.decode_only))
            engine.output.emit(sched, ref)
    return gaps


def _run(path: str, dtype: str, prompts) -> list[tuple[float, bool]]:
    engine = build_offload_engine(path, dtype=dtype, block_size=4, max_num_batched_tokens=16, policy="lru",
                                  fraction=0.5)
    try:
        assert engine.runner.graph is not None, path
        engine.runner.fast = None  # every step through forward_paged: the graph's or the modules'
        gens = [engine.start(p, SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1 if i == 0 else None))
                for i, p in enumerate(prompts)]
        gaps = _compare(engine)
        assert engine.runner.graph.steps >= len(gaps)
    finally:
        engine.close()
    assert all(len(g.drain()) == 6 for g in gens)
    return gaps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_every_step_matches_the_modules(checkpoints, tmp_path, family, dtype):
    if family in HELPER_FAMILIES:
        path, ids = checkpoints(family), list(range(3, 90))
    else:
        path, ids = families.build(family, tmp_path), list(families.PROMPT_IDS)
    steps = _run(path, dtype, [ids[:11], ids[11:15], ids[20:60]])
    assert len(steps) >= 8, steps  # prefill chunks, mixed steps and decode steps were compared
    gaps = [gap for gap, _ in steps]
    if dtype == "float32":
        assert max(gaps) == 0.0, gaps
    else:
        assert sorted(gaps)[len(gaps) // 2] == 0.0 and max(gaps) < 2e-2, gaps
