"""The fused decode path for MLA families: a decode step of a DeepSeek-V3-layout model without transformers' modules
around attention.

    ids [M] -> embedding -> rotary cos/sin (the model's rotary module)
      -> per layer: its kernel layer's decode_mla (moe_offload.Layer, kernels/csrc/cpu/mla.cpp): RMSNorm, q_a|kv_a
         (one GEMV over their fused rows), q_a_layernorm, q_b | q_proj, mla_prologue_bf16 (kv_a_layernorm, latents
         into the paged pool, rotary on k_rot and q's rope slice as the model's rotary functions round),
         mla_decode_bf16 over each sequence's pool rows (kv_b_proj absorbed: mla.py), o_proj, residual, RMSNorm:
         the same call the whole-step call makes per layer
         -> DeepSeek-V3's MoE block as moe_blocks.py runs it (fused selection, the executor, shared experts), a dense
            silu MLP in one call (mlp_rows), any other MLP as its module (a MoE module's experts still go to the executor)
      (every expert resident: all of this for every layer in one C++ call instead, runtime/decode_step.py)
      -> final norm -> LM head -> logits [M, V]

Why: in the module path a DeepSeek-V3-layout decode step spends about a third of its time in ~2000 small torch
ops (norms in 6-7 ops, the cache update, the split/cat/transpose of MLA, dtype copies; docs/benchmarks/engine.md); here
the attention half is ~12 calls per layer.

Which models: those whose description (control/description.py) has MLA attention, i.e. the registry's families
with DeepSeek-V3's layers (control/families.py; tests/engines/offload/test_family_registry.py checks each against the
installed transformers' source), in bf16 on the CPU with the kernels built and the paged cache.
Each step computes what the module path computes, at the same roundings, through the same kernels (logits equal
where the routes agree; tests/engines/offload/runtime/test_mla.py).
Legend: M sequences (one token each), H hidden, Hh heads, N/P/V nope/rope/value head dims, R kv_lora_rank.
"""

from __future__ import annotations

import time

import torch

from moe_offload.control.description import ModelDescription, MoEBlock
from moe_offload.engines.offload.kernels import jit
from moe_offload.engines.offload.loading.quant import BlockLinear, QuantLinear
from moe_offload.engines.offload.runtime.decode_step import StepCall
from moe_offload.engines.offload.runtime.moe_blocks import block_for, mlp_rows
from moe_offload.engines.offload.runtime.weights import fuse_linears, mlp_args, weight_and_scale
from moe_offload.log import get_logger

log = get_logger("moe_offload.fastpath")


class MLADecodePlan:
    """Built once per engine by ``build`` (or None); ``forward`` runs one decode-only step, as fastpath.DecodePlan."""

    def __init__(self, model, executor, pool, desc: ModelDescription):
        self.model, self.executor, self.pool, self.desc = model, executor, pool, desc
        inner = model.model
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = list(inner.layers)
        self.blocks = [block_for(layer.mlp, d.ffn) if isinstance(d.ffn, MoEBlock) else None  # None: its module runs
                       for layer, d in zip(self.layers, desc.layers)]
        # q_a and kv_a read the same input: one GEMV over their rows (the modules' weights become views of it), as
        # (rows, scales): bf16 (scales None), or --dense-dtype int8's rows (gemv_q)
        self.qkv_a = [fuse_linears(a.q_a_proj, a.kv_a_proj_with_mqa) if a.q_lora_rank is not None else None
                      for a in (layer.self_attn for layer in self.layers)]
        self.interleave = bool(self.layers[0].self_attn.config.rope_interleave)  # DeepSeek's rotary layout
        # a dense layer's silu MLP in one kernel call (mlp_rows), else None: its module runs
        self.dense = [mlp_args(layer.mlp) if block is None and not hasattr(layer.mlp, "experts") else None
                      for layer, block in zip(self.layers, self.blocks)]
        # each layer's attention half as a kernel layer (Layer.decode_mla; the whole-step call adds its MLP to it)
        self.kernels = [_kernel(layer.self_attn, layer, qkv_a, pool, self.interleave)
                        for layer, qkv_a in zip(self.layers, self.qkv_a)]
        self.steps = 0
        self.step_call = False  # decode_step.StepCall, None (the per-layer loop), False: (re)build at the next step

    @classmethod
    def build(cls, model, executor, pool, desc: ModelDescription) -> "MLADecodePlan | None":
        try:
            why = cls._refuse(model, executor, desc)
        except (AttributeError, TypeError, ValueError) as e:  # a layout it does not expect: the module path
            why = f"{type(e).__name__}: {e}"
        if why:
            log.warning("MLA fused decode path off: decode steps run transformers' modules (slower)", reason=why,
                        model_type=getattr(model.config, "model_type", ""))
            return None
        plan = cls(model, executor, pool, desc)
        log.info("fused decode path on", model_type=model.config.model_type, layers=len(plan.layers),
                 attention="mla (absorbed)", router="fused" if any(plan.blocks) else "module")
        plan.step_call = StepCall.build_mla(plan)  # now, not in the user's first decode step
        return plan

    @staticmethod
    def _refuse(model, executor, desc: ModelDescription) -> str:
        if desc.path != "fused" or desc.attention != "mla":
            return desc.why or "not MLA attention"
        inner = getattr(model, "model", None)
        if executor is None or inner is None or not all(
                hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "unexpected module layout"
        if len(inner.layers) != len(desc.layers):
            return f"{len(inner.layers)} layers, the description has {len(desc.layers)}"
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            if not getattr(attn, "_moe_offload_mla", False):
                return "MLA attention not absorbed (mla.py)"
            # the absorbed attention reads kv_b_proj's bf16 weight per head; the other projections may be
            # --dense-dtype int8's QuantLinear (or a GGUF file's blocks), called as gemv_q as the module path calls them
            if type(attn.kv_b_proj) is not torch.nn.Linear:
                return "kv_b_proj not an nn.Linear"
            linears = [attn.kv_a_proj_with_mqa, attn.o_proj]
            linears += [attn.q_a_proj, attn.q_b_proj] if attn.q_lora_rank is not None else [attn.q_proj]
            if any(type(m) not in (torch.nn.Linear, QuantLinear, BlockLinear) for m in linears):
                return "attention projections neither nn.Linear nor quantized rows"
            for m in [attn, layer.input_layernorm, layer.post_attention_layernorm]:
                if any(p.dtype != torch.bfloat16 or p.device.type != "cpu" for p in m.parameters()):
                    return "not bf16 on the CPU"
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Module):
            return "no LM head"
        if inner.norm.weight.dtype != torch.bfloat16 or inner.embed_tokens.weight.dtype != torch.bfloat16:
            return "not bf16 on the CPU"
        if not jit.load():
            return "kernels unavailable"
        return ""

    def forward(self, ids: list[int], lens: list[int], blocks: list[list[int]], seats: list[int] | None = None
                ) -> torch.Tensor:
        """One decode token per sequence: ids [M], lens[t] its context length including the token, blocks[t] its
        block table (seats: DecodePlan.forward's, unused: no MLA family has per-sequence state). Returns logits [M, V]."""
        M, bs = len(ids), self.pool.block_size
        lmax = max(lens)
        pos = [n - 1 for n in lens]
        slots = torch.tensor([blocks[t][p // bs] * bs + p % bs for t, p in enumerate(pos)], dtype=torch.long)
        # each sequence's pool rows of positions [0, lmax), padded with its first row: [M * lmax], in tensor ops (a
        # Python loop over every cached position would cost milliseconds a step at long contexts)
        nb = -(-lmax // bs)
        table = torch.tensor([b[:nb] + [b[0]] * (nb - len(b[:nb])) for b in blocks], dtype=torch.long)  # [M, nb]
        rows_t = (table.unsqueeze(2) * bs + torch.arange(bs)).reshape(M, -1)[:, :lmax]  # [M, lmax]
        pad = torch.arange(lmax).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)
        rows_t = torch.where(pad, rows_t[:, :1], rows_t).reshape(-1).contiguous()
        lens_t = torch.tensor(lens, dtype=torch.long)
        h = self.embed(torch.tensor(ids, dtype=torch.long))  # [M, H]
        cos, sin = self.rotary(h, torch.tensor(pos, dtype=torch.long).unsqueeze(0))  # [1, M, P]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        ex = self.executor
        t0 = time.perf_counter()
        ex.begin_forward()
        if self.step_call is False:
            self.step_call = StepCall.build_mla(self)
        if self.step_call is not None and self.step_call.takes(M):  # every layer in one call
            x = self.step_call.run_mla(h, cos, sin, slots, rows_t, lens_t, self.norm.weight, self.norm.variance_epsilon)
            return self._logits(x, t0)
        add = None
        for k, layer, block, dense in zip(self.kernels, self.layers, self.blocks, self.dense):
            h, x2, _, _ = k.decode_mla(h, add, cos, sin, slots, rows_t, lens_t)
            if block is not None:
                add = block(ex, x2)
            elif dense is not None:
                add = mlp_rows(x2, *dense)
            else:
                out = layer.mlp(x2.unsqueeze(0))
                add = (out[0] if isinstance(out, tuple) else out)[0]
        return self._logits(torch.ops.moe_offload.rmsnorm_bf16(h, add, self.norm.weight, self.norm.variance_epsilon),
                            t0)

    def _logits(self, x: torch.Tensor, t0: float) -> torch.Tensor:
        logits = self.lm_head(x)  # [M, V]
        self.executor.end_forward(t0)
        self.steps += 1
        return logits


def _kernel(a, layer, qkv_a, pool, interleave: bool):
    """The MLA attention half of ``layer`` (attention module ``a``) as a moe_offload.Layer: its norms, latent and rope
    pools, q_a|kv_a fused rows (``qkv_a``) or kv_a_proj_with_mqa, q_b | q_proj, kv_b_proj, o_proj, int8 rows' scales."""
    k = torch.classes.moe_offload.Layer()
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    k.norms(n1.weight, n2.weight, n1.variance_epsilon, n2.variance_epsilon, "rms")
    k.pools(*pool.layer_of(a.layer_idx, 1, a.kv_lora_rank, 1, a.qk_rope_head_dim, torch.bfloat16), pool.block_size)
    lora = a.q_lora_rank is not None
    wq = a.q_b_proj if lora else a.q_proj
    kv_a = None if lora else a.kv_a_proj_with_mqa
    (wq_w, wq_s), (wo_w, wo_s) = weight_and_scale(wq), weight_and_scale(a.o_proj)
    kv_a_w, kv_a_s = weight_and_scale(kv_a) if kv_a is not None else (None, None)
    qkv_a_w, qkv_a_s = qkv_a if qkv_a is not None else (None, None)
    k.mla(qkv_a_w, a.q_lora_rank or 0, a.q_a_layernorm.weight if lora else None,
          a.q_a_layernorm.variance_epsilon if lora else 0.0, wq_w, wq.bias, kv_a_w, kv_a.bias if kv_a is not None else None,
          a.kv_a_layernorm.weight, a.kv_a_layernorm.variance_epsilon, a.kv_b_proj.weight, a.num_heads,
          a.qk_nope_head_dim, float(a.scaling), interleave)
    k.mla_scales(wq_s, qkv_a_s, kv_a_s)
    k.output(wo_w, a.o_proj.bias, wo_s)
    return k
