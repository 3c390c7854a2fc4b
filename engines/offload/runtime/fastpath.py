"""The fused decode path: a decode step (every scheduled sequence decoding one token) without transformers' modules.

    ids [M] -> embedding -> rotary cos/sin (the model's own rotary module: every rope scaling it knows)
      -> per layer: moe_offload::decode_layer_bf16 (norm, q/k/v, q/k norms, rotary, paged KV write, attention,
         o_proj, residual, norm, router top-k; kernels/csrc/cpu/decode.cpp)
         or, a gated-DeltaNet layer, moe_offload::deltanet_layer_bf16 (norm, projections, the conv and delta rule on
         the sequence's seat in the pool, gated norm, out_proj, residual, norm, router; deltanet.LinearLayer)
         -> the offload executor with those top-k ids and weights (tiers, fetches, statistics: unchanged)
         (+ Qwen2-MoE's gated shared expert in one call, moe_offload::shared_expert_bf16; a dense layer's silu MLP in
          one call, moe_blocks.mlp_rows; any other shared expert or MLP through its own modules)
      (every expert resident: all of this for every layer in one C++ call instead, runtime/decode_step.py)
      -> final norm (moe_offload::rmsnorm_bf16) -> LM head -> logits [M, V]

Why: the module path spends about as long in small torch ops as in reading weights (docs/benchmarks/engine.md,
decode-step profile); this path makes one call per layer for everything but the experts.

When: the model's description (control/description.py, from the family registry control/families.py) says
every layer is a kind this path computes, bf16 weights on the CPU with the kernels built, the paged KV cache, and a
decode-only step. The description decides what each layer computes (norm kind, rotary kind and table or NoPE, window,
router kind: in the layer call for softmax routers, a MoE block's selection in moe_blocks.py for the others, or the
block's module); this file only binds it to the model's weights and runs it. The roundings of each family's module
path are mirrored. Anything else, a prefill chunk, fp32, CUDA run the module path. The KV rows it writes are the
rows the module path writes, so the two paths mix freely within a sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moe_offload.control.description import Attention, LinearMixer, ModelDescription, MoEBlock, Rotary
from moe_offload.engines.offload.kernels import jit, ops
from moe_offload.engines.offload.loading.quant import BlockLinear, QuantLinear
from moe_offload.engines.offload.runtime import deltanet
from moe_offload.engines.offload.runtime.decode_step import StepCall
from moe_offload.engines.offload.runtime.moe_blocks import block_for, mlp_args, mlp_rows
from moe_offload.log import get_logger

log = get_logger("moe_offload.fastpath")


def _shared_args(se, gate) -> tuple | None:
    """(gate|up rows fused, down, gate weight, gate|up scales, down scales) of a Qwen2-MoE shared expert that
    shared_expert_bf16 computes: a silu MLP mlp_rows takes (bf16, int8 rows, ggml blocks) and a bias-free bf16 [1, H]
    gate; else None (the modules run)."""
    if not (type(gate) is torch.nn.Linear and gate.bias is None
            and gate.weight.dtype == torch.bfloat16 and gate.weight.shape[0] == 1):
        return None
    args = mlp_args(se)
    if args is None:
        return None
    gate_up, down, gate_up_scale, down_scale = args
    return gate_up, down, gate.weight, gate_up_scale, down_scale


def _eps(norm) -> float:
    """An RMSNorm's epsilon (``variance_epsilon``; Qwen3-Next's zero-centred norm calls it ``eps``)."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def _attention_args(layer, attn, eps: float, window: int | None) -> tuple:
    """decode_layer_bf16's weight arguments of a softmax-attention layer: (ln1, eps, q, k, v, their biases, q/k norms),
    (scaling, window, o, its bias, ln2); int8 rows or ggml blocks where the projections hold them."""
    q8 = isinstance(attn.q_proj, (QuantLinear, BlockLinear))
    w_of = (lambda m: m.weight_q) if q8 else (lambda m: m.weight)
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return ((layer.input_layernorm.weight, eps, w_of(attn.q_proj), w_of(attn.k_proj), w_of(attn.v_proj),
             attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias,
             qn.weight if qn is not None else None, kn.weight if kn is not None else None),
            (float(attn.scaling), int(window or 0), w_of(attn.o_proj), attn.o_proj.bias,
             layer.post_attention_layernorm.weight))


def _head_dim(inner) -> int | None:
    """The head dim of the model's softmax attention (its first layer that has one)."""
    return next((layer.self_attn.head_dim for layer in inner.layers if getattr(layer, "self_attn", None) is not None), None)


@dataclass
class _Layer:
    idx: int
    args: tuple  # decode_layer_bf16's weight arguments, in order (see DecodePlan.forward)
    moe: object | None  # the MoE block (router inside the fused call) or None
    experts: object | None
    state: object | None  # the experts module's executor state
    mlp: object | None  # a dense layer's MLP module
    shared: object | None  # (shared_expert, shared_expert_gate) of a Qwen2-MoE block
    top_k: int = 0
    norm_topk: bool = False
    router: object | None = None  # [E, H]
    router_bias: object | None = None  # [E]
    sinks: object | None = None  # [Hq]
    scales: tuple = (None, None, None, None)  # int8 q/k/v/o: fp32 row scales
    block: object | None = None  # a MoE block run without its module (moe_blocks.py), else None
    shared_args: tuple | None = None  # (gate_up [2I, H], down [H, I], gate [1, H], scales x 2) for shared_expert_bf16
    dense: tuple | None = None  # a dense layer's silu MLP as mlp_args gives it (gate_up, down, scales x 2), else None
    linear: object | None = None  # a gated-DeltaNet layer (deltanet.LinearLayer): args then holds (ln1, eps), (ln2,)
    rotary: Rotary | None = None  # an attention layer's rotary (None: NoPE)


class DecodePlan:
    """Built once per engine by ``build`` from the model's description; ``forward`` runs one decode-only step."""

    def __init__(self, model, executor, desc: ModelDescription, layers: list[_Layer], eps: float, bs: int, pool):
        self.model, self.executor, self.desc = model, executor, desc
        self.codes = ops.layer_codes(desc)
        self.layers, self.eps, self.bs, self.pool = layers, eps, bs, pool
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = model.lm_head
        self.head_dim = _head_dim(inner)
        self.linear = [lay for lay in layers if lay.linear is not None]  # gated-DeltaNet layers, in order
        # one cos/sin per step serves every layer (the whole-step call takes one); else per rotary (a table per layer
        # type, or none: NoPE layers rotate by the identity, cos 1 and sin 0, which leaves q and k bit for bit)
        self.uniform_rotary = desc.uniform_rotary
        self.rotaries = list(dict.fromkeys(lay.rotary for lay in layers if lay.linear is None))  # the step's tables
        self.steps = 0
        self.step_call = False  # decode_step.StepCall, None (the per-layer loop), False: not built yet

    # -- binding the description to the model's weights ------------------------------------------------------------
    @classmethod
    def build(cls, model, executor, pool, desc: ModelDescription) -> "DecodePlan | None":
        """The plan for this model, or None (with the reason logged) where the module path must run. Never raises: a
        module layout that does not hold what the description says means the module path."""
        try:
            return cls._build(model, executor, pool, desc)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:
            log.info("fused decode path off: decode steps run transformers' modules", reason=f"{type(e).__name__}: {e}",
                     model_type=desc.model_type)
            return None

    @classmethod
    def _build(cls, model, executor, pool, desc: ModelDescription) -> "DecodePlan | None":
        why = cls._refuse(model, executor, desc)
        if why:
            log.info("fused decode path off: decode steps run transformers' modules", reason=why,
                     model_type=desc.model_type)
            return None
        eps = _eps(model.model.norm)
        layers = []
        for i, (layer, d) in enumerate(zip(model.model.layers, desc.layers)):
            attn = getattr(layer, "self_attn", None)
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (qn, kn) if n is not None]
            if any(_eps(n) != eps for n in norms):
                return _off("norms with different eps")
            mlp = layer.mlp
            experts = getattr(mlp, "experts", None)
            state = getattr(experts, "_moe_offload", None) if experts is not None else None
            if isinstance(d.ffn, MoEBlock) != (experts is not None):
                return _off(f"layer {i}: the description and the modules disagree on a MoE layer")
            if experts is not None and state is None:
                return _off(f"layer {i}: experts not served by the executor")
            fused = isinstance(d.ffn, MoEBlock) and _router_in_layer_call(d.ffn)
            router = _router_module(mlp) if fused else None
            if fused and router is None:
                return _off(f"layer {i}: no router weight")
            moe = mlp if fused else None
            shared = None
            if moe is not None and d.ffn.shared_gate:
                shared = (mlp.shared_expert, mlp.shared_expert_gate)
            elif moe is not None and (d.ffn.shared_experts
                                      or any(hasattr(mlp, n) for n in ("shared_expert", "shared_experts"))):
                return _off(f"layer {i}: shared experts without a gate beside a router in the layer call")
            if isinstance(d.mixer, LinearMixer):  # a gated-DeltaNet layer: one deltanet_layer_bf16 call
                lay = _Layer(i, ((layer.input_layernorm.weight, eps), (layer.post_attention_layernorm.weight,)), moe,
                             experts, state, None if moe is not None else mlp, shared)
                lay.linear = deltanet.LinearLayer.of(layer.linear_attn)
                if lay.linear is None:
                    return _off(f"layer {i}: linear attention the layer call does not take")
            else:
                lay = _Layer(i, _attention_args(layer, attn, eps, d.mixer.window), moe, experts, state,
                             None if moe is not None else mlp, shared)
                lay.rotary = d.mixer.rotary
                lay.sinks = getattr(attn, "sinks", None)
                if isinstance(attn.q_proj, (QuantLinear, BlockLinear)):  # --dense-dtype int8, a GGUF file's blocks
                    lay.scales = tuple(getattr(attn, a).weight_scale for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
            if moe is None and experts is not None:  # the block's selection by kind, or its module (runs_as_module)
                lay.block = block_for(mlp, d.ffn)
            if shared is not None:
                lay.shared_args = _shared_args(*shared)
            if experts is None:
                lay.dense = mlp_args(mlp)
            if moe is not None:
                if any(t is not None and t.dtype != torch.bfloat16 for t in (router.weight, getattr(router, "bias", None))):
                    return _off(f"layer {i}: router not bf16")
                lay.router = router.weight
                lay.router_bias = getattr(router, "bias", None)
                lay.top_k = d.ffn.router.top_k
                lay.norm_topk = d.ffn.router.renormalise
            if lay.linear is not None and lay.router_bias is not None:
                return _off(f"layer {i}: a router bias beside linear attention")
            layers.append(lay)
        log.info("fused decode path on", model_type=desc.model_type, layers=len(layers),
                 router="fused" if any(lay.moe is not None for lay in layers) else "module")
        return cls(model, executor, desc, layers, eps, pool.block_size, pool)

    @staticmethod
    def _refuse(model, executor, desc: ModelDescription) -> str:
        if desc.path != "fused":
            return desc.why
        if desc.attention == "mla":
            return "MLA attention (mla_plan.py)"
        cfg = model.config
        if executor is None:
            return "no offload executor"
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "unexpected module layout"
        if len(inner.layers) != len(desc.layers):
            return f"{len(inner.layers)} layers, the description has {len(desc.layers)}"
        if not isinstance(getattr(model, "lm_head", None), (torch.nn.Linear, QuantLinear, BlockLinear)):
            return "no linear LM head"
        if getattr(cfg, "clip_qkv", None) is not None:
            return "clip_qkv"
        for layer in inner.layers:
            norms = [getattr(layer, a, None) for a in ("input_layernorm", "post_attention_layernorm")]
            if not all(hasattr(n, "weight") and (hasattr(n, "variance_epsilon") or hasattr(n, "eps")) for n in norms):
                return "not the two RMSNorms around the token mixer"
            if not hasattr(layer, "mlp"):
                return "no mlp"
            attn = getattr(layer, "self_attn", None)
            if attn is None and hasattr(layer, "linear_attn"):  # gated DeltaNet: deltanet.LinearLayer decides (_build)
                if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for m in (layer.input_layernorm,
                       layer.post_attention_layernorm) for p in m.parameters()):
                    return "not bf16 on the CPU"
                continue
            kinds = {type(getattr(attn, a, None)) for a in ("q_proj", "k_proj", "v_proj", "o_proj")}
            if not (kinds == {torch.nn.Linear} or kinds <= {QuantLinear, BlockLinear}):
                return "attention without q/k/v/o projections (all nn.Linear, or all int8 / ggml blocks)"
            for norm, proj in ((getattr(attn, "q_norm", None), attn.q_proj), (getattr(attn, "k_norm", None), attn.k_proj)):
                if norm is not None and norm.weight.numel() not in (attn.head_dim, proj.out_features):
                    return f"a q/k norm of {norm.weight.numel()} values"  # per head, or over the projection
            # what the fused call reads must be bf16 on the CPU (a router's fp32 correction bias may stay fp32)
            for m in (attn, layer.input_layernorm, layer.post_attention_layernorm):
                if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in m.parameters()):
                    return "not bf16 on the CPU"
        if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in (inner.norm.weight, inner.embed_tokens.weight)):
            return "not bf16 on the CPU"
        if isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype != torch.bfloat16:
            return "not bf16 on the CPU"
        head_dim = _head_dim(inner)
        if head_dim is None:
            return "no attention layer"
        for rotary in {lay.mixer.rotary for lay in desc.layers if isinstance(lay.mixer, Attention)} - {None}:
            cos, _ = _cos_sin(inner.rotary_emb, torch.zeros(1, 1, cfg.hidden_size, dtype=torch.bfloat16),
                              torch.zeros(1, 1, dtype=torch.long), rotary, raw=True)
            kind, d = rotary.kind, cos.shape[-1]
            if kind == "interleaved_fp32" and not (d == head_dim and cos.dtype == torch.float32):
                return f"fp32 rotary of {d} dims on heads of {head_dim} expected"
            if not (d == head_dim or (kind == "halves" and 2 * d == head_dim)
                    or (kind == "partial" and d < head_dim and d % 2 == 0)):
                return f"rotary of {d} dims on heads of {head_dim}"
        if not jit.load():
            return "kernels unavailable"
        return ""

    # -- one step -----------------------------------------------------------------------------------------------
    def forward(self, ids: list[int], lens: list[int], blocks: list[list[int]], seats: list[int] | None = None
                ) -> torch.Tensor:
        """One decode token per sequence: ids [M], lens[t] = its context length including the token, blocks[t] its
        block table, seats[t] its seat in the pool's per-sequence states (gated-DeltaNet layers). Returns logits [M, V]."""
        M = len(ids)
        nb = max(len(b) for b in blocks)
        table = torch.tensor([b + [b[0]] * (nb - len(b)) for b in blocks], dtype=torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long)
        pos = lens_t.sub(1).unsqueeze(0)  # [1, M]
        h = self.embed(torch.tensor(ids, dtype=torch.long))  # [M, H]
        rot = {r: _cos_sin(self.rotary, h, pos, r)
               for r in {lay.rotary for lay in self.layers if lay.linear is None} - {None}}
        if any(lay.rotary is None and lay.linear is None for lay in self.layers):  # NoPE: the identity rotation
            d = max((c.shape[-1] for c, _ in rot.values()), default=self.head_dim)
            rot[None] = (h.new_ones(M, d), h.new_zeros(M, d))
        cos, sin = next(iter(rot.values())) if rot else (None, None)  # the one table when uniform_rotary
        ex = self.executor
        t0 = time.perf_counter()
        ex.begin_forward()
        if self.step_call is False:
            self.step_call = StepCall.build(self)
        states = {}  # gated-DeltaNet layers: their (conv, state) pools, fresh sequences' seats zeroed
        if self.linear:
            fresh = [t for t, n in enumerate(lens) if n == 1]  # sequences whose state starts at this token
            states = {lay.idx: lay.linear.states(self.pool, seats, fresh, h.dtype) for lay in self.linear}
            seats_t = torch.tensor(seats, dtype=torch.long)
        if self.step_call is not None and self.step_call.takes(M):  # every layer in one call
            if not self.uniform_rotary:
                x = self.step_call.run_tables(h, [rot[r][0] for r in self.rotaries], [rot[r][1] for r in self.rotaries],
                                              table, lens_t, self.norm.weight, self.eps,
                                              seats_t if self.linear else None,
                                              [t for lay in self.linear for t in states[lay.idx]])
            elif self.linear:
                x = self.step_call.run_hybrid(h, cos, sin, table, lens_t, self.norm.weight, self.eps, seats_t,
                                              [t for lay in self.linear for t in states[lay.idx]])
            else:
                x = self.step_call.run(h, cos, sin, table, lens_t, self.norm.weight, self.eps)
            return self._logits(x, t0)
        op = torch.ops.moe_offload.decode_layer_bf16
        add = None
        c = self.codes
        for lay in self.layers:
            if lay.linear is not None:
                (ln1, eps), (ln2,) = lay.args
                h, x2, idx, w = lay.linear.step(states[lay.idx], h, add, ln1, eps, ln2, lay.router, lay.top_k,
                                                lay.norm_topk, c.w_bf16, c.norm_mode, seats_t)
            else:
                (ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn), (scaling, window, wo, bo, ln2) = lay.args
                hd = self.head_dim
                kp, vp = self.pool.layer_of(lay.idx, wk.shape[0] // hd, hd, wv.shape[0] // hd, hd, torch.bfloat16)
                cos, sin = rot[lay.rotary]
                h, x2, idx, w = op(h, add, ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn, cos, sin, kp, vp, table, lens_t,
                                   self.bs, scaling, window, wo, bo, ln2, lay.router, lay.top_k, lay.norm_topk,
                                   c.w_bf16, lay.sinks, lay.router_bias, c.norm_mode, c.router_mode, *lay.scales,
                                   c.rope_mode, c.gated)
            if lay.moe is not None:
                out = ex.forward(lay.state, lay.experts, x2, idx, w)
                if lay.shared_args is not None:  # one kernel call, rounded as the module's ops round
                    out = out + torch.ops.moe_offload.shared_expert_bf16(x2, *lay.shared_args)
                elif lay.shared is not None:
                    se, gate = lay.shared
                    out = out + torch.sigmoid(gate(x2)) * se(x2)
            elif lay.block is not None:
                out = lay.block(ex, x2)
            elif lay.dense is not None:  # one kernel call for every row
                out = mlp_rows(x2, *lay.dense)
            else:  # a dense layer's MLP, or a MoE block run as its module (its experts still go to the executor)
                out = lay.mlp(x2.unsqueeze(0))
                out = (out[0] if isinstance(out, tuple) else out)[0]
            add = out.contiguous()
        return self._logits(torch.ops.moe_offload.rmsnorm_bf16(h, add, self.norm.weight, self.eps, c.norm_mode), t0)

    def _logits(self, x: torch.Tensor, t0: float) -> torch.Tensor:
        logits = self.lm_head(x)  # [M, V]
        self.executor.end_forward(t0)
        self.steps += 1
        return logits


def _off(reason: str) -> None:
    log.info("fused decode path off: decode steps run transformers' modules", reason=reason)
    return None


def _router_in_layer_call(block: MoEBlock) -> bool:
    """decode_layer_bf16 computes this block's router itself: softmax scores (over every expert, or over the top-k
    logits) without a correction bias; other routers are a MoE block's selection (moe_blocks.block_for)."""
    r = block.router
    return not block.runs_as_module and r.scoring == "softmax" and not r.correction_bias and r.groups is None


def _router_module(mlp):
    """The MoE block's router linear: its ``gate`` or its ``router`` (gpt-oss), whichever holds a weight."""
    for name in ("gate", "router"):
        m = getattr(mlp, name, None)
        if hasattr(m, "weight") and hasattr(m, "top_k"):
            return m
    return None


def _cos_sin(module, h: torch.Tensor, pos: torch.Tensor, rotary: Rotary, raw: bool = False):
    """cos, sin [M, RD] of ``rotary`` at positions pos [1, M] from the model's own rotary module (every rope scaling it
    knows; a table per layer type where the family keeps one), laid out as decode_layer_bf16 reads them. ``raw``: as
    the module returns them ([1, M, D'])."""
    cos, sin = module(h, pos, rotary.table) if rotary.table else module(h, pos)  # [1, M, D']
    if raw:
        return cos, sin
    if rotary.kind == "halves":  # gpt-oss: cos/sin of D/2 over the two halves = rotate_half over [cos, cos], [sin, sin]
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif rotary.kind == "interleaved_fp32":  # pair j's angle: the first half (the module repeats it interleaved)
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
    return cos[0].contiguous(), sin[0].contiguous()
