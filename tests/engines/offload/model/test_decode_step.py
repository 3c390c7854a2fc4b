"""The whole-step decode call (model/decode_step.py, kernels/csrc/cpu/step.cpp) against the per-layer loop it
replaces: the same kernels in the same order and the executor's combine as torch computes it, so the logits must be
identical bit for bit, the routes the same, and the executor's books (hits, per-token attribution) the same.

Each decode-only step runs on both paths from the same KV state, with one and with three sequences. Why it could
fail: the combine summing in another order or rounding the products where torch does not (Mixtral keeps fp32
router weights, the others bf16), pairs grouped in another order, a layer's KV pool or experts mixed up, the
routes booked to the wrong layer.
"""

from __future__ import annotations

import pytest
import torch

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.model import decode_step
from moe_offload.engines.offload.runtime.build import build_offload_engine
from moe_offload.engines.params import SamplingParams

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")

PROMPTS = ([3, 17, 42, 9, 88, 5, 61, 23], [7, 7, 100, 2], list(range(50, 90)))


def _both_paths(path: str, prompts=PROMPTS, steps: int = 12, ready=None, **options) -> int:
    """Decode ``prompts`` together; every decode-only step computed with the whole-step call and with the per-layer
    loop, compared. ``ready(engine)`` runs first. Returns how many steps were compared."""
    engine = build_offload_engine(path, dtype="bfloat16", block_size=4, fraction=1.0, **options)
    compared = 0
    try:
        if ready is not None:
            ready(engine)
        runner, ex = engine.runner, engine.executor
        plan = runner.fast
        gens = [engine.start(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in prompts]
        for _ in range(4 * steps):
            sched = engine.scheduler.schedule()
            if sched.is_empty:
                break
            with torch.inference_mode():
                if not all(n == 1 for _, n in sched.scheduled):
                    engine.output.emit(sched, runner.forward_paged(sched))
                    continue
                out = []
                # per-sequence states (linear attention) advance in place: the loop starts from the same ones
                states = {i: [t.clone() for t in ts] for i, ts in engine.pool.states.items()}
                for whole in (True, False):
                    if whole:
                        plan.step_call = False  # built at the first decode step, or rebuilt: the same object
                    if not whole:
                        plan.step_call = None
                    ex.capture(True)
                    before = ex.stats.snapshot()["layers"]
                    logits = runner.forward_fast(sched)
                    after = ex.stats.snapshot()["layers"]
                    tokens = None if ex.token_stats is None else ex.token_stats.clone()
                    out.append((logits, ex.captured()[0], {k: after[k]["hits"] - before[k]["hits"] for k in after},
                                tokens))
                    ex.capture(False)
                    if whole:
                        assert plan.step_call is not None and plan.step_call.calls == 1, "whole-step call not taken"
                        for i, ts in states.items():
                            for live, saved in zip(engine.pool.states[i], ts):
                                live[: saved.shape[0]].copy_(saved)
                plan.step_call = False
                (a, ra, ha, ta), (b, rb, hb, tb) = out
                assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
                assert ra == rb and ha == hb
                assert (ta is None) == (tb is None) and (ta is None or torch.equal(ta, tb))
                top_k = len(next(iter(ra.values()))[0])  # routes of the MoE layers (a dense layer has none)
                assert all(v == len(sched.scheduled) * top_k for v in ha.values()), ha  # every pair a hit
                compared += 1
                engine.output.emit(sched, b)
        assert all(len(g.drain()) == steps for g in gens)
    finally:
        engine.close()
    return compared


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_whole_step_equals_the_layer_loop_bf16(checkpoints, family):
    assert _both_paths(checkpoints(family)) >= 8  # three sequences, then the longest alone


@pytest.mark.parametrize("dense", ["bf16", "int8"])
def test_whole_step_equals_the_layer_loop_hybrid(tmp_path, dense):
    # Qwen3-Next: gated-DeltaNet layers (their seats' states passed with each step) around gated attention
    from offload_helpers import build_qwen3_next

    def ready(engine):
        assert [lay.linear is not None for lay in engine.runner.fast.layers] == [True, False, True]

    assert _both_paths(build_qwen3_next(tmp_path / "q3n"), ready=ready, dense_dtype=dense) >= 8


@pytest.mark.parametrize("family", ["glm4_moe", "dots1", "solar_open", "minimax_m2", "ernie4_5_moe"])
def test_whole_step_equals_the_layer_loop_deepseek_block(tmp_path, family):
    # DeepSeek-V3's MoE block in attention-fused families: the grouped sigmoid router (fp32 logits, correction bias),
    # the shared experts and a first dense layer, all inside the call
    import families

    path = families.build(family, tmp_path)
    ids = families.PROMPT_IDS
    assert _both_paths(path, prompts=(list(ids[:8]), list(ids[10:14]), list(ids[20:60]))) >= 8


@pytest.mark.parametrize("family", ["mellum", "exaone_moe"])
def test_whole_step_equals_the_layer_loop_with_a_rotary_table_per_layer(tmp_path, family):
    # the two families registered by one line: mellum's sliding and full layers rotate by tables of their own (a theta
    # each), exaone_moe's global layers by none (NoPE: the identity table); each layer takes its table in the call
    import families

    def ready(engine):
        plan = engine.runner.fast
        assert not plan.uniform_rotary and len(plan.rotaries) == 2, plan.rotaries

    ids = families.PROMPT_IDS
    path = families.build(family, tmp_path)
    assert _both_paths(path, prompts=(list(ids[:8]), list(ids[10:14]), list(ids[20:60])), ready=ready) >= 8


def test_whole_step_equals_the_layer_loop_mla(checkpoints, tmp_path):
    # DeepSeek-V3's layout: MLA attention over the latent pool (q_a|kv_a fused, q_a_layernorm, q_b), a dense first
    # layer, the grouped router and a shared expert; GLM-4.7-Flash's copy of it too
    import families

    assert _both_paths(checkpoints("deepseek_v3")) >= 8
    ids = families.PROMPT_IDS
    lite = families.build("glm4_moe_lite", tmp_path)
    assert _both_paths(lite, prompts=(list(ids[:8]), list(ids[10:14]), list(ids[20:60]))) >= 8


def test_whole_step_equals_the_layer_loop_mla_without_q_lora(checkpoints, tmp_path):
    # DeepSeek-V2-Lite's variant: q_proj straight from the normed input, kv_a_proj_with_mqa on its own
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(checkpoints("deepseek_v3"))
    cfg.q_lora_rank = None
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "no_q_lora")
    assert _both_paths(str(tmp_path / "no_q_lora")) >= 8


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_whole_step_equals_the_layer_loop_int8_experts(checkpoints, family):
    # int8 experts and int8 dense linears (deepseek_v3: MLA's q_a|kv_a, q_b_proj and o_proj through gemv_q from the
    # call, the shared expert and the dense first layer through moe_experts_q; qwen2_moe's gated shared expert too)
    assert _both_paths(checkpoints(family), expert_dtype="int8", dense_dtype="int8", ready=_every_dense_linear_int8) >= 8


def _every_dense_linear_int8(engine) -> None:
    """--dense-dtype int8 leaves bf16 only what no row kernel reads: routers, Qwen2-MoE's [1, H] shared-expert gate and
    MLA's kv_b_proj (the absorbed attention reads it per head); everything else is int8 rows and the whole-step call
    takes them (a linear missed here would be read at twice the bytes)."""
    from moe_offload.engines.offload.loading.quant import QuantLinear

    bf16 = {n.rsplit(".", 1)[-1] for n, m in engine.model.named_modules() if type(m) is torch.nn.Linear}
    assert bf16 <= {"gate", "shared_expert_gate", "kv_b_proj"}, bf16
    assert sum(isinstance(m, QuantLinear) for m in engine.model.modules()) > 0
    from moe_offload.engines.offload.model.decode_step import StepCall

    plan = engine.runner.fast
    assert StepCall.build(plan) is not None


def test_whole_step_equals_the_layer_loop_gpt_oss_mxfp4(quantized_checkpoints):
    # gpt-oss's release layout: MXFP4 experts as shipped, biased, clamped SwiGLU, through moe_experts_q in the call
    assert _both_paths(quantized_checkpoints("gpt_oss_mxfp4")) >= 8


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_whole_step_equals_the_layer_loop_gguf(tmp_path, family):
    # the file's blocks throughout: q4_k/q6_k experts; q8_0 attention (deepseek_v3: MLA's q_a|kv_a, q_b and o; kv_b
    # dequantized, the absorbed attention reads it per head), LM head, and (qwen2_moe, glm4_moe, deepseek_v3) shared
    # experts and the dense first layer's MLP, which stay BlockLinears the call reads through moe_experts_q
    from gguf_helpers import write

    from moe_offload.engines.offload.loading.quant import BlockLinear

    def ready(engine):
        mlps = [m for n, m in engine.model.named_modules() if n.endswith(("shared_expert", "shared_experts"))
                or (n.endswith(".mlp") and hasattr(m, "gate_proj"))]
        assert (len(mlps) > 0) == (family != "qwen3_moe")
        assert all(isinstance(getattr(m, a), BlockLinear) for m in mlps for a in ("gate_proj", "up_proj", "down_proj"))
        if family == "deepseek_v3":
            for layer in engine.model.model.layers:
                a = layer.self_attn
                assert all(isinstance(getattr(a, n), BlockLinear) for n in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                                                                            "o_proj"))
                assert type(a.kv_b_proj) is torch.nn.Linear
        from moe_offload.engines.offload.model.decode_step import StepCall

        plan = engine.runner.fast  # the call takes every block linear (a refused one would mean the loop alone)
        assert StepCall.build(plan) is not None

    path, _ = write(family, tmp_path, "q4_k", down_qtype="q6_k")
    assert _both_paths(str(path), prompts=([5, 9, 33, 2], [60, 61, 62]), ready=ready) >= 8


def test_whole_step_over_the_expert_store_once_read_in(tmp_path):
    # experts in host slots over the expert store file, every one pinned: the call runs once the background reads
    # have landed (the loop runs before, waiting for what it routes to)
    from offload_helpers import build_checkpoint

    from moe_offload.engines.offload.loading.convert import convert_checkpoint

    path = build_checkpoint("qwen3_moe", tmp_path)
    convert_checkpoint(path, "bfloat16")

    def ready(engine):
        assert engine.executor.disk is not None and engine.executor.layers[0].store.pending
        for st in engine.executor.layers:
            for fut in list(st.store.pending.values()):
                fut.result()

    assert _both_paths(path, ready=ready) >= 8


def test_whole_step_is_taken_only_where_every_expert_is_resident(checkpoints, monkeypatch):
    def plan_step(path, **options):
        engine = build_offload_engine(path, dtype="bfloat16", **options)
        try:
            list(engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
            return engine.runner.fast.step_call
        finally:
            engine.close()

    assert plan_step(checkpoints("qwen3_moe"), fraction=1.0) is not None
    assert plan_step(checkpoints("qwen3_moe"), fraction=0.5) is None  # misses: the executor decides per layer
    assert plan_step(checkpoints("gpt_oss"), fraction=1.0) is not None  # biased, clamped experts in the call too
    monkeypatch.setattr(decode_step, "_refuse", lambda *a: "refused")  # the per-layer loop, as a refusal gives
    assert plan_step(checkpoints("qwen3_moe"), fraction=1.0) is None


def test_decode_step_rejects_bad_layers():
    step = torch.classes.moe_offload.DecodeStep()
    h = torch.zeros(1, 8, dtype=torch.bfloat16)
    one = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), h[0], 1e-6)
    with pytest.raises(RuntimeError, match="no layers"):
        step.step(h, [h], [h], *one, None, [])
    with pytest.raises(RuntimeError, match="of 0 linear layers"):  # states for linear layers it does not have
        step.step(h, [h], [h], *one, torch.zeros(1, dtype=torch.long), [h, h])
    w = torch.zeros(4, 8, dtype=torch.bfloat16)

    def layer(top_k, experts=4):  # a router of four experts (add checks the routing tables, not the attention)
        k = torch.classes.moe_offload.Layer()
        k.norms(h[0], h[0], 1e-6, 1e-6, "rms")
        k.attention(w, w, w, 1.0, 0, "rotate_half", False)
        k.pools(w, w, 4)
        k.output(w, None, None)
        k.router(w, None, top_k, True, "score_then_topk", True)
        k.experts([w] * experts, [], [w] * experts, [], False)
        step.add(k)

    with pytest.raises(RuntimeError, match="by expert id"):
        layer(2, experts=1)
    layer(2)
    with pytest.raises(RuntimeError, match="one top-k"):
        layer(3)
    with pytest.raises(RuntimeError, match="router order"):
        torch.classes.moe_offload.Layer().router(w, None, 2, True, "sorted", True)


def test_a_layer_the_call_refuses_leaves_the_loop(checkpoints):
    # weights the C++ checks refuse at build (here a router of 3 experts for a layer of 8) mean the per-layer loop,
    # with a log line, never a failed request
    from moe_offload.engines.offload.model.decode_step import StepCall

    engine = build_offload_engine(checkpoints("qwen3_moe"), dtype="bfloat16", fraction=1.0)
    try:
        plan = engine.runner.fast
        router, r = engine.model.model.layers[0].mlp.gate.weight, engine.runner.desc.layers[0].ffn.router
        plan.layers[0].kernel.router(router[:3], None, r.top_k, r.renormalise, r.order, True)
        assert StepCall.build(plan) is None
        plan.layers[0].kernel.router(router, None, r.top_k, r.renormalise, r.order, True)
        assert StepCall.build(plan) is not None
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["granitemoe", "granitemoeshared", "aria"])
def test_whole_step_equals_the_layer_loop_with_residual_multipliers(tmp_path, family):
    # Granite 3 MoE: every residual branch scaled (residual_multiplier, bf16(branch * s) before the add) inside the
    # call, and in the loop's layer calls and its last branch; the embedding and logits multipliers around both.
    # GraniteMoeShared's shared MLP beside the block and Aria's ungated shared experts: one mlp_rows added in the call
    import families

    ids = families.PROMPT_IDS
    path = families.build(family, tmp_path)
    assert _both_paths(path, prompts=(list(ids[:8]), list(ids[10:14]), list(ids[20:60]))) >= 8


def test_whole_step_equals_the_layer_loop_deepseek_v2(tmp_path):
    # MLA rotated by the complex fp32 table, and the greedy softmax router (scaled, fp32 weights) in the call
    import families

    ids = families.PROMPT_IDS
    path = families.build("deepseek_v2", tmp_path)
    assert _both_paths(path, prompts=(list(ids[:8]), list(ids[10:14]), list(ids[20:60]))) >= 8
