"""The gated-DeltaNet decode kernel (kernels/csrc/cpu/deltanet.cpp, model/deltanet.py) against the module it
replaces: Qwen3-Next's linear-attention layer, stepped one token at a time from the same cached state.

Why it could fail: q/k/v/z or b/a taken from the wrong place of the projections' per-key-head layout, a value head
paired with the wrong key head, the conv state shifted the wrong way, the decay or beta computed in another dtype, the
gated norm rounding elsewhere than the module, the cache's tensors not updated in place (the next step would then
start from stale state and drift)."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.engines.offload.model import deltanet
from moe_offload.engines.offload.runtime import model_runner

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")


FAMILIES = ("qwen3_next", "qwen3_5_moe")  # per-key-head grouped projections; Qwen3.5's separate ones


def _checkpoint(family_checkpoints, family) -> str:
    path = family_checkpoints(family)
    if isinstance(path, Exception):
        pytest.fail(f"{family}: cannot build its tiny checkpoint: {path}")
    return path


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_steps_match_the_module(family_checkpoints, monkeypatch, batch, family):
    from transformers import DynamicCache

    om = load_model(_checkpoint(family_checkpoints, family), None, dtype="bfloat16")  # convolutions widened to fp32
    layers = [m for m in om.model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert deltanet.install(om.model, "gated_deltanet") == len(layers) > 0
    calls = []
    op = torch.ops.moe_offload.gated_delta_decode_bf16
    monkeypatch.setattr(torch.ops.moe_offload, "gated_delta_decode_bf16", lambda *a: calls.append(1) or op(*a))
    layer = layers[0]
    module_forward = type(layer).forward.__get__(layer)
    g = torch.Generator().manual_seed(0)
    config = om.model.config.get_text_config()
    H = config.hidden_size

    def x(n):
        return torch.randn(batch, n, H, generator=g).to(torch.bfloat16)

    mine = DynamicCache(config=config)
    with torch.inference_mode():
        layer(x(6), cache=mine)  # a prefill: the module's own path, in both
        theirs = copy.deepcopy(mine)
        conv = mine.get_conv_state(layer.layer_idx)
        for step in range(5):
            xt = x(1)
            got, want = layer(xt, cache=mine), module_forward(xt, cache=theirs)
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (batch, 1, H)
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
            # the conv window holds bf16 inputs: exactly the module's; the recurrent state to fp32 rounding
            assert mine.get_conv_state(layer.layer_idx) is conv  # updated in place, as the module's copy_ does
            assert torch.equal(conv, theirs.get_conv_state(layer.layer_idx))
            torch.testing.assert_close(mine.get_recurrent_state(layer.layer_idx),
                                       theirs.get_recurrent_state(layer.layer_idx), rtol=1e-4, atol=1e-5)
    assert len(calls) == 5  # every one-token step went through the kernel, the prefill did not


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_tokens_with_and_without_the_kernel(family_checkpoints, monkeypatch, family):
    # bf16 greedy decoding of three sequences batched through the paged engine's module path: the kernel's decode rows
    # (states in the pool's seats) and the module's give the same tokens; the switch keeps the kernel out. The fused
    # decode path (Qwen3-Next: Layer.decode_linear per layer, the same step inside) gives them too.
    from moe_offload.control.families import FAMILIES as REGISTRY
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    path = _checkpoint(family_checkpoints, family)
    on_fused_path = REGISTRY[family].attention != "module"
    if on_fused_path:
        fused = _engine_tokens(build_offload_engine(path, dtype="bfloat16"))
    monkeypatch.setattr(model_runner, "decode_plan", lambda *a: None)  # the module path
    calls = []
    op = torch.ops.moe_offload.gated_delta_decode_bf16
    monkeypatch.setattr(torch.ops.moe_offload, "gated_delta_decode_bf16", lambda *a: calls.append(a[0].shape[0]) or op(*a))

    def tokens():
        engine = build_offload_engine(path, dtype="bfloat16")
        assert engine.paged and engine.deltanet_layers > 0
        return _engine_tokens(engine, fused=False)

    on = tokens()
    assert calls and max(calls) == 3  # decode rows of the three sequences in one call
    calls.clear()
    monkeypatch.setattr(deltanet, "_kernel_takes", lambda layer, x: False)  # the module's own code for every row
    off = tokens()
    assert not calls
    assert on == off and all(len(t) == 10 for t in on)
    if on_fused_path:
        assert fused == on


def _engine_tokens(engine, fused: bool = True) -> list[list[int]]:
    """Ten greedy tokens for each of three prompts, batched, on the fused decode path or the module path; the engine
    is closed."""
    from moe_offload.engines.params import SamplingParams

    try:
        assert (engine.runner.fast is not None) == fused
        gens = [engine.start(p, SamplingParams(max_tokens=10, ignore_eos=True))
                for p in ([5, 17, 42, 9, 88], [3, 3, 61], [70, 71, 72, 73, 74, 75, 76, 77, 78])]
        while engine.step():
            pass
        return [g.drain() for g in gens]
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_int8_holds_the_deltanet_projections_as_int8(family_checkpoints, monkeypatch, family):
    # --dense-dtype int8: the layer's input and output projections are int8 rows too (else a hybrid's int8 step reads
    # them at twice q8_0's bytes); the kernel takes their outputs, and its decode steps still run (on the module path)
    from moe_offload.engines.offload.loading.quant import QuantLinear
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    calls = []
    op = torch.ops.moe_offload.gated_delta_decode_bf16
    monkeypatch.setattr(torch.ops.moe_offload, "gated_delta_decode_bf16", lambda *a: calls.append(1) or op(*a))
    monkeypatch.setattr(model_runner, "decode_plan", lambda *a: None)  # the module path
    engine = build_offload_engine(_checkpoint(family_checkpoints, family), dtype="bfloat16", expert_dtype="int8",
                                  dense_dtype="int8")
    try:
        layers = [m for m in engine.model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
        assert layers and all(isinstance(m.out_proj, QuantLinear) for m in layers)
        bf16 = {n.rsplit(".", 1)[-1] for n, m in engine.model.named_modules()
                if type(m) is torch.nn.Linear and ".visual." not in f".{n}."}  # Qwen3.5's vision tower stays as it is
        assert bf16 <= {"gate", "shared_expert_gate"}, bf16
        assert len(list(engine.generate([5, 17, 42, 9], SamplingParams(max_tokens=6, ignore_eos=True)))) == 6
    finally:
        engine.close()
    assert calls
