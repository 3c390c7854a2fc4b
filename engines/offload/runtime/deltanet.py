"""Gated-DeltaNet layers (Qwen3-Next's linear attention, and every family whose layer has its source) decode a token in
one kernel call instead of ~70 torch ops.

    layer(hidden [B, 1, H], cache) --a cached one-token step, bf16 on the CPU-->
      in_proj_qkvz, in_proj_ba (the modules: patched GEMVs, --dense-dtype int8 rows)
      -> moe_offload::gated_delta_decode_bf16 (kernels/csrc/cpu/deltanet.cpp): the conv update and the gated delta
         rule on the cache's own conv and recurrent state tensors (updated in place, as the module's copy_ updates
         them), the gated RMSNorm
      -> out_proj
    anything else (prefill, no cache, a cache recording its past, fp32, a convolution not widened to fp32) -> the
    module's own forward

Why: on a 2-core host a Qwen3-Next decode step spent a quarter of its time in those small ops (per-op dispatch, fp32
casts, broadcasts; bench/profile_decode.py). Which layers, by construction: the layer's forward, its helpers and its
gated norm must have Qwen3-Next's source (moe_blocks.same_source; helpers compared as source text).
Exactness: the kernel follows the module's dtypes and element-wise operation order; its reductions over a head's dims
are ordered differently, so outputs agree to bf16 rounding (tests/engines/offload/kernels/test_deltanet.py).
``MOE_OFFLOAD_DELTANET=0`` keeps the module.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from moe_offload.engines.offload import switches
from moe_offload.engines.offload.runtime.moe_blocks import same_source

ENV = "MOE_OFFLOAD_DELTANET"
HELPERS = ("causal_conv1d_update", "torch_recurrent_gated_delta_rule", "l2norm", "apply_mask_to_padding_states")


def _reference():
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    return ref


def _same_helpers(layer) -> bool:
    ref, mod = _reference(), sys.modules[type(layer).__module__]
    try:
        return all(inspect.getsource(getattr(mod, f)) == inspect.getsource(getattr(ref, f)) for f in HELPERS) and (
            inspect.getsource(type(layer).fix_query_key_value_ordering)
            == inspect.getsource(ref.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering))
    except (AttributeError, OSError, TypeError):
        return False


def install(model: torch.nn.Module) -> int:
    """Route the one-token steps of every covered gated-DeltaNet layer of ``model`` through the kernel; returns how
    many layers. Nothing happens without the kernels, with the switch off, or for layers of another source."""
    from moe_offload.engines.offload.kernels import jit

    if not switches.on(ENV):
        return 0
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not layers or not jit.load():
        return 0
    ref = _reference()
    n = 0
    for m in layers:
        if isinstance(m.__dict__.get("forward"), functools.partial):  # installed before (a second engine)
            n += 1
        elif (same_source(m, ref.Qwen3NextGatedDeltaNet) and same_source(getattr(m, "norm", None), ref.Qwen3NextRMSNormGated)
                and m.activation == "silu" and _same_helpers(m)):
            m.forward = functools.partial(_forward, m, m.forward)
            n += 1
    return n


def _forward(layer, module_forward, hidden_states, cache=None, attention_mask=None, **kwargs):
    """The layer's forward: the kernel for a cached one-token bf16 CPU step, else the module's."""
    conv, norm = layer.conv1d, layer.norm
    states = None
    if (cache is not None and hidden_states.dim() == 3 and hidden_states.shape[1] == 1
            and hidden_states.dtype == torch.bfloat16 and hidden_states.is_cpu and conv.weight.dtype == torch.float32
            and norm.weight.dtype == torch.bfloat16 and not cache.is_recording_past(layer.layer_idx)):
        cs = cache.get_conv_state(layer.layer_idx, state_idx=0)
        rs = cache.get_recurrent_state(layer.layer_idx, state_idx=0)
        if (cs is not None and rs is not None and cs.dtype == torch.bfloat16 and rs.dtype == torch.float32
                and cs.is_contiguous() and rs.is_contiguous() and cs.shape[-1] == layer.conv_kernel_size):
            states = cs, rs
    if states is None:
        return module_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hidden_states = sys.modules[type(layer).__module__].apply_mask_to_padding_states(hidden_states, attention_mask)
    B = hidden_states.shape[0]
    qkvz = layer.in_proj_qkvz(hidden_states).reshape(B, -1).contiguous()
    ba = layer.in_proj_ba(hidden_states).reshape(B, -1).contiguous()
    out = torch.ops.moe_offload.gated_delta_decode_bf16(
        qkvz, ba, states[0], conv.weight.squeeze(1), None if conv.bias is None else conv.bias.float(), states[1],
        layer.A_log.float(), layer.dt_bias.float(), norm.weight, float(norm.variance_epsilon), layer.num_k_heads,
        layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    return layer.out_proj(out.view(B, 1, -1))
