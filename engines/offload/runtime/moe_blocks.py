"""MoE blocks the fused decode paths run without their modules, chosen by the model description's router kind.

    block_for(mlp, MoEBlock description) --router kind-->
        grouped_sigmoid: DeepSeek-V3's block (sigmoid router with correction bias and expert groups, shared experts;
            also GLM-4.5+, dots.llm1, Kimi K2, ...) as
            F.linear(x, router fp32) -> sigmoid -> moe_offload::grouped_topk (kernels/csrc/cpu/router.cpp)
            -> the offload executor (tiers, fetches, statistics) + shared experts (mlp_rows: one kernel call)
        sigmoid_topk: MiniMax-M2's (sigmoid scores + correction bias, top-k, no groups, no shared expert), the same
            selection call with one group
        softmax_bias: Ernie 4.5's (fp32 softmax scores + correction bias to choose, weights rounded to bf16, shared
            experts)
        anything else, or experts the executor does not serve: None (the block runs as its module)

Why: the module's router is ~15 small torch ops per layer; the selection is one call here. The logits and the
sigmoid are the module's own ops, the selection the module's fp32 operations (tests: test_fastpath.py, test_mla.py).
Which family has which router is the registry's word (control/families.py), never read from a module's source.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels.dispatch import scale_arg
from moe_offload.engines.offload.kernels.ops import experts
from moe_offload.engines.offload.runtime.weights import mlp_args


def mlp_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x . gate) * (x . up) -> down for every row of x [M, H] (bf16) in one kernel call, as one expert taking
    every token: the weights read once for all rows. bf16 weights: moe_offload::moe_experts_bf16, each row
    bit-identical to that kernel's of it alone (rounded as an MLP module's three bf16 linears round); int8 rows +
    scales or ggml blocks: moe_experts_q likewise. The whole-step call (step.cpp) makes the same calls."""
    idx = torch.arange(x.shape[0])
    q = gate_up.dtype != torch.bfloat16
    return experts(x, [gate_up], [down], idx, idx, [0], [x.shape[0]], torch.empty_like(x),
                   [scale_arg(gate_up_scale)] if q else None, [scale_arg(down_scale)] if q else None)


def plus_shared(out: torch.Tensor, x: torch.Tensor, shared, shared_args: tuple | None) -> torch.Tensor:
    """``out`` + the shared experts' output for x: one mlp_rows call over their fused rows where it takes x (bf16 rows),
    else the module."""
    if shared_args is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous():
        return out + mlp_rows(x, *shared_args)
    return out + shared(x)


def _served(mlp):
    """The experts module of ``mlp`` when the executor serves those experts, else None."""
    experts = getattr(mlp, "experts", None)
    return experts if getattr(experts, "_moe_offload", None) is not None else None


class DeepseekBlock:
    """DeepSeek-V3's MoE block for decode rows: ``block(executor, x [M, H]) -> [M, H]``, as the module computes it.
    The shared experts run as one ``mlp_rows`` call over their gate|up rows fused (``fuse_rows``)."""

    def __init__(self, mlp, state):
        self.gate, self.experts, self.shared, self.state = mlp.gate, mlp.experts, mlp.shared_experts, state
        g = self.gate
        self.args = (int(g.num_group), int(g.topk_group), int(g.top_k), bool(g.norm_topk_prob), float(g.routed_scaling_factor))
        self.shared_args = mlp_args(self.shared)  # (gate_up, down) or None: the module runs

    def router_args(self) -> tuple:
        """grouped_router's arguments for the whole-step call: fp32 weights, bias, groups, top-k, norm, scale, scores
        (sigmoid), weights rounded to bf16 (no)."""
        g = self.gate
        return (g.weight.detach().float().contiguous(), g.e_score_correction_bias.detach().float(), *self.args, "sigmoid", False)

    def __call__(self, ex, x: torch.Tensor) -> torch.Tensor:
        g = self.gate
        scores = F.linear(x.type(torch.float32), g.weight.type(torch.float32)).sigmoid()  # [M, E], the module's ops
        ids, w = torch.ops.moe_offload.grouped_topk(scores, g.e_score_correction_bias.float(), *self.args)
        return plus_shared(ex.forward(self.state, self.experts, x, ids, w), x, self.shared, self.shared_args)


class SigmoidTopkBlock:
    """MiniMax-M2's MoE block for decode rows, as the module computes it: the router's logits in its weight's dtype
    (bf16 weights: moe_offload::gemm_bf16, each logit a dot rounded once as F.linear rounds it, summed in the kernels'
    order: torch's bf16 GEMM costs ~20-40 us a call at these shapes, a tenth of a layer; else ``F.linear``), their
    fp32 sigmoid, + the correction bias to choose, the chosen sigmoid scores over their sum (moe_offload::grouped_topk
    with one group), the executor; no shared expert."""

    shared_args = None

    def __init__(self, mlp, state):
        self.gate, self.experts, self.bias, self.state = mlp.gate, mlp.experts, mlp.e_score_correction_bias, state
        self.args = (1, 1, int(mlp.gate.top_k), True, 1.0)

    def router_args(self) -> tuple:
        """grouped_router's arguments: the router weights as stored (logits in their dtype), bias, selection."""
        return (self.gate.weight.detach(), self.bias.detach().float(), *self.args, "sigmoid", False)

    def __call__(self, ex, x: torch.Tensor) -> torch.Tensor:
        w = self.gate.weight
        x = x.to(w.dtype)
        logits = torch.ops.moe_offload.gemm_bf16(x, w) if w.dtype == torch.bfloat16 else F.linear(x, w)
        scores = logits.float().sigmoid()  # [M, E], the module's ops
        ids, weights = torch.ops.moe_offload.grouped_topk(scores, self.bias.float(), *self.args)
        return ex.forward(self.state, self.experts, x, ids, weights)


class SoftmaxBiasBlock:
    """Ernie 4.5's MoE block for decode rows, as the module computes it: fp32 logits, their softmax, + the correction
    bias to choose top-k, the chosen softmax scores over their sum, rounded to bf16; shared experts added (mlp_rows)."""

    def __init__(self, mlp, state):
        self.gate, self.experts, self.shared, self.state = mlp.gate, mlp.experts, mlp.shared_experts, state
        self.bias = mlp.gate.moe_statics.e_score_correction_bias
        self.args = (1, 1, int(mlp.gate.top_k), True, 1.0)
        self.shared_args = None if self.shared is None else mlp_args(self.shared)

    def router_args(self) -> tuple:
        g = self.gate
        return (g.weight.detach().float().contiguous(), self.bias.detach().float().reshape(-1), *self.args, "softmax", True)

    def __call__(self, ex, x: torch.Tensor) -> torch.Tensor:
        g = self.gate
        scores = F.softmax(F.linear(x.float(), g.weight.float()), dim=1, dtype=torch.float)  # the module's ops
        ids, w = torch.ops.moe_offload.grouped_topk(scores, self.bias.float().reshape(-1), *self.args)
        out = ex.forward(self.state, self.experts, x, ids, w.to(x.dtype))
        return out if self.shared is None else plus_shared(out, x, self.shared, self.shared_args)


def deepseek_block(mlp) -> DeepseekBlock | None:
    """DeepSeek-V3's block for ``mlp`` (a grouped_sigmoid router) with its experts on the executor, else None: experts
    not served, or groups the selection call does not take."""
    experts = _served(mlp)
    if experts is None or not hasattr(mlp, "shared_experts"):
        return None
    g = mlp.gate
    if g.num_experts % g.num_group or g.top_k > (g.num_experts // g.num_group) * g.topk_group:
        return None
    return DeepseekBlock(mlp, experts._moe_offload)


def block_for(mlp, block) -> DeepseekBlock | SigmoidTopkBlock | SoftmaxBiasBlock | None:
    """The block that runs ``mlp`` for decode rows, by the description's router kind (``block``: a
    description.MoEBlock); None where its module must run."""
    experts = _served(mlp)
    if experts is None or block.runs_as_module:
        return None
    r = block.router
    if r.scoring == "sigmoid" and r.groups is not None:
        return deepseek_block(mlp)
    if r.scoring == "sigmoid" and r.correction_bias and hasattr(mlp, "e_score_correction_bias"):
        return SigmoidTopkBlock(mlp, experts._moe_offload)
    if r.scoring == "softmax" and r.correction_bias:
        return SoftmaxBiasBlock(mlp, experts._moe_offload)
    return None
