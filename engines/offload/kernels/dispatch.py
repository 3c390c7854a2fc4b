"""The one expert kernel: a set of tokens through one expert.

Every path (accelerator slots, host store, fetched slots) calls ``expert_forward``,
so where host and accelerator share device type and precision the results are
bit-identical and greedy output does not depend on the resident fraction.

    one bf16 token on the CPU --> moe_offload::moe_experts_bf16 (silu gate, concatenated gate|up: ops.token_experts)
                              |   moe_offload::gemv_bf16 x2 around the module's own gate (other gates)
    2..16 bf16 tokens on the CPU (a batched decode step) --> moe_offload::gemm_bf16 x2 around the gate
    quantized weights (int8 | fp8 | mxfp4 | ggml blocks, the format is the stored dtype; quant.py):
      1..16 tokens on the CPU --> moe_offload::moe_experts_q (one token, silu gate, int8/fp8/ggml: ops.token_experts)
                              |   moe_offload::gemv_q x2 around the module's own gate (biases, gpt-oss, mxfp4)
      more tokens, CUDA, kernels off --> dequantize the expert to x's dtype, then the float path (a GEMM)
    anything else (prefill, fp32, CUDA, transposed layout) --> two GEMMs around the module's gate (gemm.py: torch's,
                                                              in fp32 tiles for bf16 on CPUs without bf16 dot)

The custom ops (csrc/cpu/) stream each weight once at memory bandwidth; F.linear is what
transformers' experts implementations compute. The owned graph's blocks call the model's bf16 nn.Linear layers
(attention projections, dense MLPs, LM head) through ``bound`` / ``call`` (one token: the same GEMV, a few: the GEMM
kernel); the fallback that runs transformers' modules patches them instead (``patch_linears``).
MOE_OFFLOAD_KERNELS=0 turns both off.

Legend: N tokens routed to this expert, H hidden, I intermediate (2I gate+up).
"""

from __future__ import annotations

import functools
import types
import weakref

import torch

from moe_offload.engines.offload.kernels import gemm, jit, ops
from moe_offload.engines.offload.kernels.ops import MAX_TOKENS, token_experts
from moe_offload.engines.offload.loading import ggml, quant


def expert_forward(
    module: torch.nn.Module,
    x: torch.Tensor,  # [N, H]
    up: torch.Tensor,  # [2I, H] ([H, 2I] when module.is_transposed and not quantized); [I, H] without a gate
    down: torch.Tensor,  # [H, I] ([I, H] when transposed and not quantized)
    up_bias: torch.Tensor | None = None,  # [2I]
    down_bias: torch.Tensor | None = None,  # [H]
    up_scale: torch.Tensor | None = None,  # quantized up: int8 [2I], fp8 [RB, CB], mxfp4 uint8 [2I, H/32]
    down_scale: torch.Tensor | None = None,  # quantized down: int8 [H], fp8 [..], mxfp4 [H, I/32]
    post_norm: bool = True,
) -> torch.Tensor:
    """Unweighted output [N, H] of one expert; the routing weight is applied by the caller's combine.
    ``post_norm=False`` leaves the module's post-expert norm (whose weights live on the accelerator) to the caller.
    The arguments are the expert's stored tensors in store order (store.WEIGHT_NAMES)."""
    if up.dtype in quant.FORMAT_OF_DTYPE:
        y = _quantized(module, x, up, down, up_bias, down_bias, up_scale, down_scale)  # [N, H] in x's dtype
    elif x.shape[0] <= GEMM_MAX_TOKENS and _fast(x, up, module.is_transposed):
        y = _few_tokens(module, x.to(up.dtype), up, down, up_bias, down_bias)  # a decode step's tokens
    else:  # prefill (or fp32, CUDA): a GEMM; bf16 on a CPU without bf16 dot instructions goes through fp32 (gemm.py)
        x = x.to(up.dtype)
        h = gemm.matmul(x, up) if module.is_transposed else gemm.linear(x, up)  # [N, 2I]
        if up_bias is not None:
            h = h + up_bias
        h = apply_gate(module, h)  # [N, I]
        y = gemm.matmul(h, down) if module.is_transposed else gemm.linear(h, down)  # [N, H]
        if down_bias is not None:
            y = y + down_bias
    return module.post_expert_norm(y) if post_norm and module.has_post_expert_norm else y


def experts_gathered(module, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """P routed pairs at once, each through its own expert: x [P, H], the pairs' float weights gathered from the slot
    buffers (up [P, 2I, H], down [P, H, I]; [P, H, 2I] and [P, I, H] when transposed; biases [P, 2I], [P, H]) ->
    [P, H] unweighted. A handful of batched kernels for a decode step's pairs instead of a few per expert: what the
    accelerator's launch rate, not its bandwidth, bounds. The same products as expert_forward's GEMMs, row by row."""

    def rows(w, v):  # each pair's vector v [P, n] through its own matrix w: [P, m]
        return torch.bmm(v.unsqueeze(1), w).squeeze(1) if module.is_transposed else torch.bmm(w, v.unsqueeze(2)).squeeze(2)

    h = rows(up, x.to(up.dtype))  # [P, 2I]
    if up_bias is not None:
        h = h + up_bias
    h = apply_gate(module, h)  # [P, I]
    y = rows(down, h)  # [P, H]
    if down_bias is not None:
        y = y + down_bias
    if module.has_post_expert_norm:
        y = module.post_expert_norm(y)
    return y


# Up to this many tokens a weight goes through moe_offload::gemm_bf16 (one read of each row for all tokens);
# beyond, torch's GEMM (prefill).
GEMM_MAX_TOKENS = 16
# An expert with more tokens than this in one step (a prefill chunk) leaves moe_experts_bf16 for torch's GEMM
# (expert_forward): at 64 tokens torch is about 3x faster, at 8-16 the two are even (bench/bench_kernels.py).
# 16, not lower: a decode step of up to 16 sequences routes at most 16 tokens to an expert, so its rows stay the
# one-token path's bit for bit (a request's tokens do not depend on the traffic beside it).
KERNEL_MAX_GROUP = GEMM_MAX_TOKENS


def fused_experts_ok(module, w: torch.Tensor, x: torch.Tensor) -> bool:
    """The whole layer's pairs can go through moe_offload::moe_experts_bf16: bf16 CPU weights in [out, in] rows,
    transformers' silu gate on concatenated gate|up without biases, or gpt-oss's clamped SwiGLU (biases read as the
    kernel reads them: bf16), no post-expert norm."""
    return (not module.has_post_expert_norm and x.dim() == 2 and _fast(x, w, module.is_transposed)
            and fused_gate(module) is not None)


def fused_gate(module) -> tuple | None:
    """moe_experts_bf16's (gate, alpha, limit) for the module's experts: (0, 0, 0) for silu(gate) * up without
    biases, (1, alpha, limit) for gpt-oss's clamped SwiGLU, None for any other gate."""
    if _is_silu_concat(module) and not getattr(module, "has_bias", False):
        return 0, 0.0, 0.0
    if module.has_gate and _is_gpt_oss_gate(module):
        return 1, float(module.alpha), float(module.limit)
    return None


def fused_experts_q_ok(module, w: torch.Tensor, x: torch.Tensor) -> bool:
    """A layer's int8/fp8/mxfp4/ggml experts can go through moe_offload::moe_experts_q, one call per tier: CPU, silu
    gate on a concatenated gate|up without biases, or (bf16 tokens) gpt-oss's biased clamped SwiGLU; no post-expert
    norm, kernels built."""
    gate = fused_gate(module)
    return (x.dim() == 2 and w.dtype in Q_FUSED and w.is_cpu and x.is_cpu and _q_kernel_dtype(w, x)
            and not module.has_post_expert_norm and gate is not None and (gate[0] == 0 or x.dtype == torch.bfloat16)
            and (w.dtype != torch.uint8 or gate[0] == 1)
            and (w.dtype != torch.float8_e4m3fn or gate[0] == 0)  # fp8 block scales assume a gate|up split
            and jit.load())


def _q_kernel_dtype(w: torch.Tensor, x: torch.Tensor) -> bool:
    """x's dtype suits the quantized kernels for weights w: bf16, or fp32 but not with ggml blocks. ggml blocks in fp32
    compute take the dequantized weights instead: the GGUF exactness contract (fp32 = transformers on the dequantized
    model, token for token) holds there, while bf16 takes llama.cpp's 8-bit activations (bounded, tested)."""
    return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and w.dtype != ggml.DTYPE)


Q_FUSED = (torch.int8, torch.float8_e4m3fn, torch.uint8, ggml.DTYPE)  # formats moe_experts_q computes (uint8: mxfp4)
NO_SCALE = torch.empty(0)  # the scale argument of ggml blocks, which carry their own


def scale_arg(s: torch.Tensor | None) -> torch.Tensor:
    return NO_SCALE if s is None else s


def gate_up_split(module, rows: int) -> int:
    """Row where a quantized gate|up's second half starts, for formats that keep the halves' scales apart (fp8):
    rows // 2 for a concatenated gate|up (DeepSeek ships gate_proj and up_proj as two tensors), else 0 (none)."""
    return rows // 2 if module.has_gate and getattr(module, "is_concatenated", True) else 0


def _quantized(module, x, up, down, up_bias, down_bias, up_scale, down_scale) -> torch.Tensor:
    """One expert from stored quantized tensors; x [N, H] -> [N, H] in x's dtype (the compute dtype)."""
    split = gate_up_split(module, up.shape[0]) if up.dtype == torch.float8_e4m3fn else 0
    if (x.is_cpu and up.is_cpu and x.shape[0] <= MAX_TOKENS and _q_kernel_dtype(up, x)
            and jit.load() and not (torch.is_grad_enabled() and x.requires_grad)):
        up_scale, down_scale = scale_arg(up_scale), scale_arg(down_scale)
        if (x.shape[0] == 1 and up.dtype != torch.uint8 and up_bias is None and down_bias is None
                and _is_silu_concat(module)):
            return token_experts(x, [up], [down], [up_scale], [down_scale])
        h = ops.gemv_q(x, up, up_scale, up_bias, split)  # [N, 2I]
        h = _gate(module, h)  # [N, I]
        return ops.gemv_q(h, down, down_scale, down_bias, 0)  # [N, H]
    # a tile per expert: the stored weights in x's dtype (fp32 products as transformers' dequantizing loaders make)
    w_up = quant.dequantize(up, up_scale, split, x.dtype)  # [2I, H]
    h = gemm.linear(x, w_up, up_bias.to(x.dtype) if up_bias is not None else None)
    h = apply_gate(module, h)
    w_down = quant.dequantize(down, down_scale, 0, x.dtype)  # [H, I]
    return gemm.linear(h, w_down, down_bias.to(x.dtype) if down_bias is not None else None)


def _fast(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> bool:
    # Checked per expert on the hot path, so only what decides the path (the op validates shapes and strides):
    # bf16 CPU weights in [out, in] rows (gpt-oss style [in, out] weights keep F.linear), nothing autograd
    # would have to differentiate (the ops have no backward), kernels built and on.
    return (
        w.dtype == torch.bfloat16
        and not transposed
        and w.is_cpu
        and jit.load()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def _few_tokens(module, x, up, down, up_bias, down_bias) -> torch.Tensor:
    """A few tokens [N, H] through one expert with the bf16 kernels, each weight row read once for all of them (the
    GEMV for one token; one token under transformers' silu gate takes the fused experts' entry): [N, H]."""
    if x.shape[0] == 1 and _is_silu_concat(module) and _bias_ok(up_bias) and _bias_ok(down_bias):
        return token_experts(x, [up], [down], up_biases=None if up_bias is None else [up_bias],
                             down_biases=None if down_bias is None else [down_bias])
    op = ops.gemv_bf16 if x.shape[0] == 1 else ops.gemm_bf16

    def linear(v, w, b):  # a bias the kernel cannot read (not bf16 CPU contiguous) added after
        y = op(v, w, b if _bias_ok(b) else None)
        return y if _bias_ok(b) else y + b

    return linear(_gate(module, linear(x, up, up_bias)).to(down.dtype), down, down_bias)


def _gate(module, h: torch.Tensor) -> torch.Tensor:
    """The expert's activation on gate|up rows h [N, 2I] -> [N, I]: gpt-oss's clamped SwiGLU in one kernel call
    (moe_offload::clamped_swiglu_bf16) where the module's gate is gpt-oss's, else the module's own ops."""
    if module.has_gate and h.dtype == torch.bfloat16 and h.is_cpu and _is_gpt_oss_gate(module):
        return ops.clamped_swiglu(h.contiguous(), float(module.alpha), float(module.limit))
    return apply_gate(module, h)


def apply_gate(module, h: torch.Tensor) -> torch.Tensor:
    """The expert's activation on its gate|up rows h [N, 2I] -> [N, I] (an expert without a gate: act_fn on h), by
    the family registry's word (set_activation): silu, act_fn(gate) * up over the concatenated halves (gate first);
    clamped_swiglu, gpt-oss's over interleaved columns (its alpha and limit); an experts module of a family the
    registry does not list: the fallback model's own gate."""
    if not module.has_gate:
        return module.act_fn(h)
    kind = _ACTIVATIONS.get(module)
    if kind == "silu" and getattr(module, "is_concatenated", True):
        gate, up = h.chunk(2, dim=-1)
        return module.act_fn(gate) * up
    if kind == "clamped_swiglu":
        gate, up = h[..., ::2].clamp(max=module.limit), h[..., 1::2].clamp(min=-module.limit, max=module.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * module.alpha))
    return _fallback_gate(module, h)


# experts module -> its activation, as the family registry names it: per module the loader served, not per class (an
# engine's word for its modules must not reach another model's modules of the same class, nor an instance's own gate)
_ACTIVATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_activation(module, activation: str) -> None:
    """Record the activation of the experts ``module`` (the loader, from control/families.py; "module" for a family
    the registry does not list: its experts' own gate)."""
    _ACTIVATIONS[module] = activation


def _is_gpt_oss_gate(module) -> bool:
    """The module's gate is gpt-oss's clamped SwiGLU by the registry (its alpha and limit read from the module)."""
    return _ACTIVATIONS.get(module) == "clamped_swiglu" and hasattr(module, "alpha") and hasattr(module, "limit")


def _bias_ok(b: torch.Tensor | None) -> bool:
    return b is None or (b.dtype == torch.bfloat16 and b.device.type == "cpu" and b.is_contiguous())


def _is_silu_concat(module) -> bool:
    """The expert's gate is silu(gate) * up over concatenated halves (gate rows first), which the fused op computes:
    by the registry's word, or (the fallback model) the module keeping transformers' default gate."""
    if not module.has_gate or not getattr(module, "is_concatenated", True):
        return False
    kind = _ACTIVATIONS.get(module)
    if kind != "silu" and not (kind in ("module", None) and _fallback_default_gate(module)):
        return False
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


# -- the fallback model's experts (a family the registry does not list): the gate is the module's own. These two are
# the only places the engine reads transformers' private gate names.
def _fallback_gate(module, h: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(h)


def _fallback_default_gate(module) -> bool:
    """The module keeps transformers' default gate (not a family's own, nor an instance's)."""
    from transformers.integrations.moe import _default_apply_gate

    return getattr(module._apply_gate, "__func__", None) is _default_apply_gate


def experts_one_token(module, x: torch.Tensor, weights: list[tuple], post_norm: bool = True) -> torch.Tensor | None:
    """Several experts of one token in one call: ``weights`` = [(up, down, up_bias, down_bias)] (slot or store views).

    Returns [K, H] whose row k is bit-identical to ``expert_forward(module, x, *weights[k])`` (so callers may
    mix both freely without breaking exactness), or None where only ``expert_forward`` applies (another gate
    than silu's or gpt-oss's, several tokens, not bf16 on the CPU, kernels off).
    """
    if x.shape[0] != 1 or not weights or not all(_fast(x, w[0], module.is_transposed) for w in weights):
        return None
    if _is_silu_concat(module):
        gate = (0, 0.0, 0.0)
    elif module.has_gate and _is_gpt_oss_gate(module):  # biases and the clamped SwiGLU in the same call
        gate = (1, float(module.alpha), float(module.limit))
    else:
        return None
    biases = []  # per position (gate|up, down): every expert's bias, or None when no expert has one
    for i in (2, 3):
        bs = [w[i] for w in weights]
        if all(b is None for b in bs):
            biases.append(None)
        elif all(b is not None and _bias_ok(b) for b in bs):
            biases.append(bs)
        else:  # some experts biased and some not, or a bias the kernel does not read
            return None
    y = token_experts(x.to(torch.bfloat16), [w[0] for w in weights], [w[1] for w in weights], None, None, *biases,
                      *gate)
    if post_norm and module.has_post_expert_norm:
        y = module.post_expert_norm(y)
    return y  # [K, H]


# -- the model's own one-token linear layers ----------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., in] @ w [out, in].T (+ b): one token on the GEMV kernel, a few on the GEMM kernel (bf16 CPU weights,
    kernels on), prefill on gemm.linear (F.linear over rows padded to a multiple of 8)."""
    if x.dtype == torch.bfloat16 and _fast(x, w, False):
        if x.numel() == w.shape[1]:
            return ops.gemv_bf16(x, w, b)
        if x.numel() <= GEMM_MAX_TOKENS * w.shape[1]:  # a batched decode step
            return ops.gemm_bf16(x, w, b)
    return gemm.linear(x, w, b)  # prefill


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def on_kernels(m: torch.nn.Module) -> bool:
    """``m`` is a bf16 CPU nn.Linear whose rows the kernels compute (bound, called or patched), kernels on."""
    return type(m) is torch.nn.Linear and _linear_ok(m) and jit.load()


def bound(m: torch.nn.Module):
    """What the owned graph's blocks call for the linear ``m``: its rows on the kernels (``linear``) where
    ``on_kernels``, else the module itself (int8 rows, ggml blocks, fp32, CUDA, kernels off). Nothing is patched."""
    return functools.partial(_linear_forward, m) if on_kernels(m) else m


def call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``bound(m)(x)`` for a call site that does not keep the binding."""
    return linear(x, m.weight, m.bias) if on_kernels(m) else m(x)


def patch_linears(model: torch.nn.Module) -> int:
    """Route one-token calls of ``model``'s bf16 CPU nn.Linear layers to ``moe_offload::gemv_bf16``: for the
    fallback that runs transformers' modules (the owned graph binds instead: ``bound``), and head-split ranks.

    Returns how many layers were patched (0 when the kernels are off or unavailable). The swap is an
    instance-level ``forward``, so state dicts, hooks and prefill are unchanged.
    """
    found = [m for m in model.modules() if type(m) is torch.nn.Linear and _linear_ok(m)]
    if not found or not jit.load():
        return 0
    for m in found:
        m.forward = types.MethodType(_linear_forward, m)
    return len(found)


def patched(m: torch.nn.Module) -> bool:
    """``m`` is an nn.Linear whose decode calls ``patch_linears`` sent to the kernels."""
    return isinstance(m, torch.nn.Linear) and getattr(m.forward, "__func__", None) is _linear_forward


def _linear_ok(m: torch.nn.Linear) -> bool:
    w, b = m.weight, m.bias
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.stride(-1) == 1 and _bias_ok(b)


def prepare(model: torch.nn.Module, expert_dtype: torch.dtype | None) -> None:
    """At load time: build the kernels now (not inside the first decode step) when the experts are bf16 or
    quantized, widen the model's gated-DeltaNet convolutions. Its linears are left as they are: the owned graph binds
    them (``bound``), the fallback patches them (``patch_linears``, model_runner.py)."""
    if expert_dtype == torch.bfloat16 or expert_dtype in quant.FORMAT_OF_DTYPE:
        jit.load()
    widen_delta_convs(model)


def widen_delta_convs(model: torch.nn.Module) -> int:
    """The short causal convolution of every gated-DeltaNet layer (Qwen3-Next's linear attention and the families that
    copy it) holds fp32 weights on the CPU: torch runs a bf16 depthwise convolution through its per-channel slow path
    (60 % of a Qwen3-Next decode step, 165k thnn_conv2d calls for 8 tokens), fp32 through its vectorized one. That
    code casts the input to the weight's dtype and the result back, so activations stay bf16: the convolution is
    computed in fp32 and rounded once. Returns how many were widened."""
    n = 0
    for parent in model.modules():
        conv = getattr(parent, "conv1d", None)
        if (type(parent).__name__.endswith("GatedDeltaNet") and type(conv) is torch.nn.Conv1d
                and conv.weight.dtype == torch.bfloat16 and conv.weight.device.type == "cpu"):
            conv.float()
            n += 1
    return n
