"""The gated-DeltaNet decode kernel (kernels/csrc/cpu/deltanet.cpp, runtime/deltanet.py) against the module it
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
from moe_offload.engines.offload.runtime import deltanet

pytestmark = pytest.mark.skipif(not jit.load(), reason="the CPU kernels cannot be built here")


def _checkpoint(family_checkpoints) -> str:
    path = family_checkpoints("qwen3_next")
    if isinstance(path, Exception):
        pytest.fail(f"qwen3_next: cannot build its tiny checkpoint: {path}")
    return path


@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_steps_match_the_module(family_checkpoints, monkeypatch, batch):
    from transformers import DynamicCache

    om = load_model(_checkpoint(family_checkpoints), None, dtype="bfloat16")  # convolutions widened to fp32
    layers = [m for m in om.model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert deltanet.install(om.model) == len(layers) > 0
    calls = []
    op = torch.ops.moe_offload.gated_delta_decode_bf16
    monkeypatch.setattr(torch.ops.moe_offload, "gated_delta_decode_bf16", lambda *a: calls.append(1) or op(*a))
    layer = layers[0]
    module_forward = type(layer).forward.__get__(layer)
    g = torch.Generator().manual_seed(0)
    H = om.model.config.hidden_size

    def x(n):
        return torch.randn(batch, n, H, generator=g).to(torch.bfloat16)

    mine = DynamicCache(config=om.model.config)
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


def test_engine_tokens_with_and_without_the_kernel(family_checkpoints, monkeypatch):
    # bf16 greedy decoding through the engine (per-sequence cache: the hybrid model is not paged): the kernel's
    # steps and the module's give the same tokens
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    path = _checkpoint(family_checkpoints)

    def tokens():
        engine = build_offload_engine(path, dtype="bfloat16")
        try:
            n = engine.runner.deltanet_layers
            return n, list(engine.generate([5, 17, 42, 9, 88], SamplingParams(max_tokens=10, ignore_eos=True)))
        finally:
            engine.close()

    n_on, on = tokens()
    monkeypatch.setenv(deltanet.ENV, "0")
    n_off, off = tokens()
    assert n_on > 0 and n_off == 0
    assert on == off
