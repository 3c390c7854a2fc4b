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
ON_THE_MODULES: dict[str, str] = {}
GRAPH_FAMILIES = sorted(set(FAMILIES) - set(ON_THE_MODULES))
SPARSE = "indexed sparse attention (a lightning indexer picks the keys)"
LINEAR = "linear attention other than gated DeltaNet"
# every other MoE family of the installed transformers runs transformers' modules (the explicit fallback, experts still
# on the executor, exact: test_families.py): what its layers hold that the graph's blocks do not express
ON_THE_FALLBACK = {
    "afmoe": "norms on the attention and MLP outputs (four a layer); a sigmoid output gate of its own projection",
    "axk1": "a norm on the MoE block's output",
    "axk2": SPARSE,
    "bailing_hybrid": LINEAR,
    "beam": "post-feedforward norms, depth-scaled residuals, a soft-capped LM head",
    "cohere2_moe": "attention and MLP in parallel on one norm",
    "deepseek_v32": SPARSE,
    "deepseek_v4": "compressed sparse attention",
    "dots3_note": SPARSE,
    "ernie4_5_vl_moe": "a rotary table laid out pair-interleaved; text and vision experts side by side in one block",
    "flex_olmo": "norms on the attention and MLP outputs instead of their inputs",
    "flint": "a sigmoid top-k router without a correction bias; an ungated shared expert",
    "gemma4": "a dense MLP and a MoE block side by side in a layer; sandwich norms; a soft-capped LM head",
    "glm5_next": f"{SPARSE}; {LINEAR}",
    "glm_moe_dsa": SPARSE,
    "granitemoe_swa": "sinks applied as a scale after the softmax; a rotary theta per layer",
    "granitemoehybrid": "Mamba-2 layers",
    "hy_v4": SPARSE,
    "hy_v4_vl": SPARSE,
    "inkling": "hybrid layers (attention and a linear state in one layer)",
    "inkling2": "hybrid layers (attention and a linear state in one layer)",
    "inkling2_loop": "hybrid layers (attention and a linear state in one layer)",
    "jamba": "Mamba layers",
    "kimi_linear": LINEAR,
    "kolibri1": "norms on the attention and MLP outputs; top-k of biased logits before the sigmoid",
    "laguna": "a softplus gate on the attention output",
    "lara_mini": LINEAR,
    "lfm2_moe": "short-convolution layers",
    "mimo_v2_flash": "value heads narrower than the keys; sinks on the sliding layers only",
    "minimax": "lightning (linear) attention",
    "minimax_m3_vl": f"{SPARSE}; clamped-SwiGLU dense and shared MLPs",
    "mistral_large4": SPARSE,
    "muse_spark": "a norm after the embedding; sandwich norms and residual gates",
    "nemotron_h": "Mamba-2 layers; attention, MLP and MoE as layers of their own",
    "phimoe": "LayerNorm; the sparsemixer router",
    "qwen3_omni_moe": "the thinker's own config type (qwen3_omni_moe_thinker), which the registry does not name",
    "qwen4_exp": f"{SPARSE}; {LINEAR}",
    "unlimited_ocr": "reference sliding attention",
    "zaya": "hybrid layers (attention and a linear state in one layer)",
}


def test_the_registry_is_split_between_the_graph_and_the_modules():
    # description-level refusals need no model; a family the graph takes gets as far as asking for the executor
    for family in FAMILIES:
        why = graph.refuse(None, None, describe(families.tiny_config(family)))
        assert why == ON_THE_MODULES.get(family, "no offload executor"), (family, why)
    assert set(GRAPH_FAMILIES) == set(FAMILIES) - set(ON_THE_MODULES)


def test_every_other_family_is_on_the_fallback_with_the_part_the_blocks_lack():
    # the list is whole: a family transformers adds, or one registered since, fails here until it is listed or moved
    runnable = {f for f in families.experts_families() if f not in families.NOT_GENERATIVE}
    assert set(ON_THE_FALLBACK) == runnable - set(FAMILIES), sorted(set(ON_THE_FALLBACK) ^ (runnable - set(FAMILIES)))
    for family in ON_THE_FALLBACK:  # not registered (a module-path registry entry would need its own reason)
        desc = describe(families.tiny_config(family))
        assert desc.path == "module" and desc.why == "family not in the registry", (family, desc.why)


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


def _family_steps(checkpoints, tmp_path, family: str, dtype: str) -> list[tuple[float, bool]]:
    """_run over three prompts of ``family``'s tiny checkpoint (the helpers' or families.py's)."""
    if family in HELPER_FAMILIES:
        path, ids = checkpoints(family), list(range(3, 90))
    else:
        path, ids = families.build(family, tmp_path), list(families.PROMPT_IDS)
    return _run(path, dtype, [ids[:11], ids[11:15], ids[20:60]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_every_step_matches_the_modules(checkpoints, tmp_path, family, dtype):
    steps = _family_steps(checkpoints, tmp_path, family, dtype)
    assert len(steps) >= 8, steps  # prefill chunks, mixed steps and decode steps were compared
    gaps = [gap for gap, _ in steps]
    if dtype == "float32":
        assert max(gaps) == 0.0, gaps
    else:
        assert sorted(gaps)[len(gaps) // 2] == 0.0 and max(gaps) < 2e-2, gaps


@pytest.fixture
def torch_ops(monkeypatch):
    """The compiled CPU kernels off for one test: every op of the graph takes its torch implementation
    (kernels/ops.native), the ops a CUDA engine's graph runs. A compiled op still called fails the test: this process
    has the library loaded, so a caller that skipped ops.native would otherwise pass unseen."""
    from moe_offload.engines.offload.kernels import jit, ops

    def compiled(name):
        raise AssertionError(f"moe_offload::{name} called with the kernels off")

    was = jit.load()
    jit.set_enabled(False)
    monkeypatch.setattr(ops, "_op", compiled)
    try:
        yield
    finally:
        jit.set_enabled(was)


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_the_graph_on_torch_ops_matches_the_modules(checkpoints, tmp_path, family, torch_ops):
    # what runs on CUDA, here on the CPU: no compiled kernel in either path (the modules' linears unpatched), so the
    # graph's torch ops (a grouped top-k of its own, the MLA and DeltaNet references) meet transformers' own modules
    steps = _family_steps(checkpoints, tmp_path, family, "bfloat16")
    assert len(steps) >= 8 and any(decode for _, decode in steps), steps
    gaps = [gap for gap, _ in steps]
    assert sorted(gaps)[len(gaps) // 2] == 0.0 and max(gaps) < 2e-2, gaps


def test_the_torch_grouped_topk_is_the_kernels():
    # the two implementations of one op (kernels/ops.py): the same experts in the same order, weights to a rounding;
    # the engine tests above hold the torch one against DeepSeek-V3's router module
    from moe_offload.engines.offload.kernels import jit, ops

    if not jit.load():
        pytest.skip("the compiled kernels are not built here")
    g = torch.Generator().manual_seed(0)
    for E, groups, kept, k, norm in ((64, 8, 4, 8, True), (16, 1, 1, 4, False), (32, 4, 2, 6, True), (8, 8, 3, 2, True)):
        scores = torch.rand(5, E, generator=g).sigmoid()
        bias = torch.randn(E, generator=g) * 0.1
        ids, w = ops.grouped_topk(scores, bias, groups, kept, k, norm, 2.5)
        tids, tw = ops._grouped_topk_torch(scores, bias, groups, kept, k, norm, 2.5)
        assert torch.equal(ids, tids), (E, groups, ids, tids)
        torch.testing.assert_close(w, tw, rtol=1e-6, atol=0)
