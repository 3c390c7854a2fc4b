"""MoE blocks the fused decode paths run without their modules, chosen by the model description's router kind.

    block_for(mlp, MoEBlock description) --router kind--> one RouterBlock, set for
        grouped_sigmoid: DeepSeek-V3's block (sigmoid router with correction bias and expert groups, shared experts;
            also GLM-4.5+, dots.llm1, Kimi K2, ...) as
            F.linear(x, router fp32) -> sigmoid -> moe_offload::grouped_topk (kernels/csrc/cpu/router.cpp)
            -> the offload executor (tiers, fetches, statistics) + shared experts (mlp_rows: one kernel call)
        sigmoid_topk: MiniMax-M2's (sigmoid scores + correction bias, top-k, no groups, no shared expert), the same
            selection call with one group
        softmax_bias: Ernie 4.5's (fp32 softmax scores + correction bias to choose, weights rounded to bf16, shared
            experts)
        softmax_greedy: DeepSeek-V2's (fp32 softmax scores, the top-k, times routed_scaling_factor, fp32 weights,
            shared experts), the selection call with one group and no bias
        anything else, or experts the executor does not serve: None (the block runs as its module)

Why: the module's router is ~15 small torch ops per layer; the selection is one call here. The logits and the
sigmoid are the module's own ops, the selection the module's fp32 operations (tests: test_fastpath.py, test_mla.py).
Which family has which router is the registry's word (control/families.py), never read from a module's source.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import ops
from moe_offload.engines.offload.kernels.dispatch import scale_arg
from moe_offload.engines.offload.kernels.ops import experts
from moe_offload.engines.offload.model.weights import mlp_args


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
    if (shared_args is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()
            and ops.native(x)):
        return out + mlp_rows(x, *shared_args)
    return out + shared(x)


def _served(mlp):
    """The experts module of ``mlp`` when the executor serves those experts, else None."""
    experts = getattr(mlp, "experts", None)
    return experts if getattr(experts, "_moe_offload", None) is not None else None


class RouterBlock:
    """A MoE block for decode rows, ``block(executor, x [M, H]) -> [M, H]``, as its module computes it: the router's
    logits (fp32, or in the router weight's dtype: bf16 weights through moe_offload::gemm_bf16, each logit a dot
    rounded once as F.linear rounds it; torch's bf16 GEMM costs ~20-40 us a call at these shapes), their fp32 sigmoid
    or softmax, + the correction bias to choose, the selection (moe_offload::grouped_topk: groups, top-k, renormalise,
    scale), the chosen weights rounded to the compute dtype where the module rounds them, the executor, and the shared
    experts as one ``mlp_rows`` call over their gate|up rows fused where they take it."""

    def __init__(self, mlp, state, bias, args: tuple, scoring: str, fp32_logits: bool = True,
                 round_weights: bool = False):
        self.gate, self.experts, self.state = mlp.gate, mlp.experts, state
        self.shared = getattr(mlp, "shared_experts", None)
        self.shared_args = None if self.shared is None else mlp_args(self.shared)  # (gate_up, down), or the module
        self.bias = None if bias is None else bias.detach().float().reshape(-1)  # None: the scores alone choose
        self.args, self.scoring = args, scoring
        self.top_k = int(args[2])
        self.fp32_logits, self.round_weights = fp32_logits, round_weights

    def router_args(self) -> tuple:
        """grouped_router's arguments for the whole-step call: the router weights (fp32, or as stored), bias,
        groups, top-k, norm, scale, scoring, weights rounded to bf16."""
        w = self.gate.weight.detach()
        return (w.float().contiguous() if self.fp32_logits else w, self.bias, *self.args, self.scoring,
                self.round_weights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's part: (ids [M, K], weights [M, K], the rows the experts take)."""
        w = self.gate.weight
        if self.fp32_logits:
            logits = F.linear(x.float(), w.float())
        else:
            x = x.to(w.dtype)
            logits = ops.gemm_bf16(x, w) if w.dtype == torch.bfloat16 else F.linear(x, w)
        if self.scoring == "softmax":
            scores = F.softmax(logits, dim=1, dtype=torch.float)  # [M, E], the module's ops
        else:
            scores = logits.float().sigmoid()
        ids, weights = ops.grouped_topk(scores, self.bias, *self.args)
        return ids, (weights.to(x.dtype) if self.round_weights else weights), x

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' rows ``out`` + the shared experts'."""
        return out if self.shared is None else plus_shared(out, x, self.shared, self.shared_args)

    def __call__(self, ex, x: torch.Tensor) -> torch.Tensor:
        ids, weights, x = self.route(x)
        return self.finish(x, ex.forward(self.state, self.experts, x, ids, weights))


def deepseek_block(mlp) -> RouterBlock | None:
    """DeepSeek-V3's block for ``mlp`` (a grouped_sigmoid router) with its experts on the executor, else None: experts
    not served, or groups the selection call does not take."""
    experts = _served(mlp)
    return None if experts is None else _grouped(mlp, experts._moe_offload)


def _grouped(mlp, state) -> RouterBlock | None:
    if not hasattr(mlp, "shared_experts"):
        return None
    g = mlp.gate
    if g.num_experts % g.num_group or g.top_k > (g.num_experts // g.num_group) * g.topk_group:
        return None
    return RouterBlock(mlp, state, g.e_score_correction_bias, (
        int(g.num_group), int(g.topk_group), int(g.top_k), bool(g.norm_topk_prob), float(g.routed_scaling_factor)),
        "sigmoid")


def block_for(mlp, block) -> RouterBlock | None:
    """The block that runs ``mlp`` for decode rows, by the description's router kind (``block``: a
    description.MoEBlock); None where its module must run."""
    experts = _served(mlp)
    if experts is None:
        return None
    return selection(mlp, block, experts._moe_offload)


def selection(mlp, block, state) -> RouterBlock | None:
    """``mlp``'s router as a RouterBlock by the description's router kind, its routed rows for ``state`` (the
    executor's layer, or what an MTP layer computes its own experts with: mtp.py uses route and finish alone);
    None where the selection call does not take it."""
    if block.runs_as_module:
        return None
    r, one_group = block.router, (1, 1, int(mlp.gate.top_k), True, 1.0)
    if r.scoring == "sigmoid" and r.groups is not None:
        return _grouped(mlp, state)
    if r.scoring == "sigmoid" and r.correction_bias and hasattr(mlp, "e_score_correction_bias"):
        return RouterBlock(mlp, state, mlp.e_score_correction_bias, one_group, "sigmoid", fp32_logits=False)
    if r.scoring == "softmax" and r.correction_bias:
        return RouterBlock(mlp, state, mlp.gate.moe_statics.e_score_correction_bias, one_group, "softmax",
                           round_weights=True)
    if r.scoring == "softmax" and r.groups is None and r.logits_dtype == "fp32":  # DeepSeek-V2's greedy top-k
        return RouterBlock(mlp, state, None, (1, 1, r.top_k, r.renormalise, r.scale), "softmax",
                           round_weights=r.weights_dtype == "model")
    return None
