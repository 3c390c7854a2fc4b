"""The fused decode path: a decode step (every scheduled sequence decoding one token) without transformers' modules.

    ids [M] -> embedding -> rotary cos/sin (the model's own rotary module: every rope scaling it knows)
      -> per layer: its kernel layer's decode (moe_offload.Layer: norm, q/k/v, q/k norms, rotary, paged KV write,
         attention, o_proj, residual, norm, router top-k; kernels/csrc/cpu/decode.cpp)
         or, an MLA layer, its decode_mla (mla_plan.py: the attention half; the router is its MoE block's),
         or, a gated-DeltaNet layer, its decode_linear (norm, projections, the conv and delta rule on the sequence's
         seat in the pool, gated norm, out_proj, residual, norm, router; deltanet.LinearLayer)
         -> the offload executor with those top-k ids and weights (tiers, fetches, statistics: unchanged)
         (+ Qwen2-MoE's gated shared expert in one call, moe_offload::shared_expert_bf16; a dense layer's silu MLP in
          one call, moe_blocks.mlp_rows; any other shared expert or MLP through its own modules)
      (every expert resident: all of this for every layer in one C++ call instead, model/decode_step.py)
      -> final norm (moe_offload::rmsnorm_bf16) -> LM head -> logits [M, V]

Why: the module path spends about as long in small torch ops as in reading weights (docs/benchmarks/engine.md,
decode-step profile); this path makes one call per layer for everything but the experts.

When: the model's description (control/description.py, from the family registry control/families.py) says
every layer is a kind this path computes, bf16 weights on the CPU with the kernels built, the paged KV cache, and a
decode-only step. The description decides what each layer computes (norm kind, rotary kind and table or NoPE, window,
router kind: in the layer call for softmax routers, a MoE block's selection in moe_blocks.py for the others, or the
block's module); fused_bind.py binds it to the model's weights, this file runs it. The roundings of each family's module
path are mirrored. Anything else, a prefill chunk, fp32, CUDA run the module path. The KV rows it writes are the
rows the module path writes, so the two paths mix freely within a sequence.
"""

from __future__ import annotations

import time

import torch

from moe_offload.control.description import ModelDescription, fused_refusal
from moe_offload.engines.offload.kernels import dispatch, ops
from moe_offload.engines.offload.model import blocks, fused_bind, mla_plan
from moe_offload.engines.offload.model.decode_step import StepCall
from moe_offload.engines.offload.model.moe_blocks import mlp_rows
from moe_offload.engines.offload.model.weights import decoder, silu_mlp
from moe_offload.log import get_logger

log = get_logger("moe_offload.fastpath")


class DecodePlan:
    """Built once per engine by ``build`` from the model's description; ``forward`` runs one decode-only step."""

    def __init__(self, model, executor, desc: ModelDescription, layers: list, eps: float, pool):
        self.model, self.executor, self.desc = model, executor, desc
        self.layers, self.eps, self.pool = layers, eps, pool
        inner = decoder(model)
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = dispatch.bound(model.lm_head)  # its rows on the GEMV kernel
        self.head_dim = fused_bind.head_dim(inner)
        self.linear = [lay for lay in layers if lay.linear is not None]  # gated-DeltaNet layers, in order
        # the step's rotary tables: one serves every layer, or one per rotary (a table per layer type, or none: NoPE
        # layers rotate by the identity, cos 1 and sin 0, which leaves q and k bit for bit)
        self.uniform_rotary = desc.uniform_rotary
        self.rotaries = list(dict.fromkeys(lay.rotary for lay in layers if lay.linear is None))
        self.mla = desc.attention == "mla"  # MLA layers (mla_plan.py): decode_mla over the step's pool rows
        self.steps = 0
        self.keep_hidden, self.hidden = False, None  # MTP drafts read the final norm's rows of each step
        self.step_call = False  # decode_step.StepCall, None (the per-layer loop), False: (re)build at the next step

    # -- binding the description to the model's weights ------------------------------------------------------------
    @classmethod
    def build(cls, model, executor, pool, desc: ModelDescription) -> "DecodePlan | None":
        """The plan for this model, or None (with the reason logged) where the module path must run. Never raises: a
        module layout that does not hold what the description says means the module path."""
        try:
            why = fused_bind.refuse(model, executor, desc)
            bound = None if why else fused_bind.bind(model, desc, pool)
        except (AttributeError, TypeError, ValueError, RuntimeError) as e:
            why, bound = f"{type(e).__name__}: {e}", None
        if isinstance(bound, str):
            why, bound = bound, None
        if bound is None:
            # a family the registry puts on this path falls back: loud (a warning reaches every command's output),
            # unless the description says so already (a part the call lacks: spec prints it, the graph decodes)
            note = log.info if why and why == fused_refusal(desc) else log.warning
            note("fused decode path off: decode steps take the slower per-op path", reason=why,
                 model_type=desc.model_type)
            return None
        layers, eps = bound
        log.info("fused decode path on", model_type=desc.model_type, layers=len(layers), attention=desc.attention,
                 router="fused" if any(lay.moe is not None for lay in layers) else "module")
        plan = cls(model, executor, desc, layers, eps, pool)
        plan.step_call = StepCall.build(plan)  # now, not in the user's first decode step (1-3 ms)
        return plan

    # -- one step -----------------------------------------------------------------------------------------------
    def forward(self, ids: list[int], lens: list[int], blocks: list[list[int]], seats: list[int] | None = None
                ) -> torch.Tensor:
        """One decode token per sequence: ids [M], lens[t] = its context length including the token, blocks[t] its
        block table, seats[t] its seat in the pool's per-sequence states (gated-DeltaNet layers). Returns logits [M, V]."""
        M = len(ids)
        lens_t = torch.tensor(lens, dtype=torch.long)
        pos = lens_t.sub(1).unsqueeze(0)  # [1, M]
        h = self.embed(torch.tensor(ids, dtype=torch.long))  # [M, H]
        if self.desc.scales.embedding != 1.0:  # Granite's embedding multiplier
            h = h * self.desc.scales.embedding
        if self.mla:
            return self._forward_mla(h, pos, lens_t, lens, blocks)
        nb = max(len(b) for b in blocks)
        table = torch.tensor([b + [b[0]] * (nb - len(b)) for b in blocks], dtype=torch.long)
        rot = {r: fused_bind.cos_sin(self.rotary, h, pos, r)
               for r in {lay.rotary for lay in self.layers if lay.linear is None} - {None}}
        if any(lay.rotary is None and lay.linear is None for lay in self.layers):  # NoPE: the identity rotation
            d = max((c.shape[-1] for c, _ in rot.values()), default=self.head_dim)
            rot[None] = (h.new_ones(M, d), h.new_zeros(M, d))
        t0 = self._begin()
        states = {}  # gated-DeltaNet layers: their (conv, state) pools, fresh sequences' seats zeroed
        if self.linear:
            fresh = [t for t, n in enumerate(lens) if n == 1]  # sequences whose state starts at this token
            states = {lay.idx: lay.linear.states(self.pool, seats, fresh, h.dtype) for lay in self.linear}
            seats_t = torch.tensor(seats, dtype=torch.long)
        if self.step_call is not None and self.step_call.takes(M):  # every layer in one call
            tables = [rot[r] for r in self.rotaries]
            x = self.step_call.run(h, [c for c, _ in tables], [s for _, s in tables], table, lens_t, self.norm.weight,
                                   self.eps, seats_t if self.linear else None,
                                   [t for lay in self.linear for t in states[lay.idx]])
            return self._logits(x, t0)
        return self._layers(h, t0, lambda lay, h, add: lay.kernel.decode_linear(h, add, *states[lay.idx], seats_t)
                            if lay.linear is not None else lay.kernel.decode(h, add, *rot[lay.rotary], table, lens_t))

    def _forward_mla(self, h, pos, lens_t, lens: list[int], blocks: list[list[int]]) -> torch.Tensor:
        """forward() for MLA layers: each token's pool row (slots) and each sequence's rows (mla_plan.step_rows)."""
        slots, rows = mla_plan.step_rows(lens, blocks, self.pool.block_size)
        # [1, M, P] bf16; DeepSeek-V2's complex table: its real and imaginary parts, fp32 [1, M, P/2]
        cos, sin = fused_bind.cos_sin(self.rotary, h, pos, self.desc.layers[0].mixer.rotary, raw=True)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        t0 = self._begin()
        if self.step_call is not None and self.step_call.takes(len(lens)):  # every layer in one call
            x = self.step_call.run_mla(h, cos, sin, slots, rows, lens_t, self.norm.weight, self.eps)
            return self._logits(x, t0)
        return self._layers(h, t0, lambda lay, h, add: lay.kernel.decode_mla(h, add, cos, sin, slots, rows, lens_t))

    def _begin(self) -> float:
        """The step's start: the executor's forward begins, the whole-step call is built if it is due."""
        t0 = time.perf_counter()
        self.executor.begin_forward()
        if self.step_call is False:
            self.step_call = StepCall.build(self)
        return t0

    def _layers(self, h: torch.Tensor, t0: float, attention) -> torch.Tensor:
        """The per-layer loop: each layer's kernel call ``attention(lay, h, add)`` -> (h, x2, ids, w), then its MLP."""
        ex, add = self.executor, None
        for lay in self.layers:
            h, x2, idx, w = attention(lay, h, add)
            if lay.moe is not None:
                out = ex.forward(lay.state, lay.experts, x2, idx, w)
                if lay.shared_args is not None:  # one kernel call, rounded as the module's ops round
                    out = out + ops.shared_expert(x2, *lay.shared_args)
                elif lay.shared is not None:
                    se, gate = lay.shared
                    out = out + torch.sigmoid(dispatch.call(gate, x2)) * blocks.MLP(se)(x2)
                elif lay.beside is not None:  # an ungated shared expert: one kernel call, added as the module adds
                    out = out + mlp_rows(x2, *lay.beside)
            elif lay.block is not None:
                out = lay.block(ex, x2)
            elif lay.dense is not None:  # one kernel call for every row
                out = mlp_rows(x2, *lay.dense)
            elif silu_mlp(lay.mlp):  # a dense layer's MLP the kernel call does not take: its linears bound
                out = blocks.MLP(lay.mlp)(x2)
            else:  # a MoE block run as its module (its experts still go to the executor)
                out = lay.mlp(x2.unsqueeze(0))
                out = (out[0] if isinstance(out, tuple) else out)[0]
            add = out.contiguous()
        if self.desc.scales.residual != 1.0:  # the last branch's multiplier (the layers apply the others)
            add = add * self.desc.scales.residual
        return self._logits(ops.rmsnorm(h, add, self.norm.weight, self.eps, self.desc.norm.kind),
                            t0)

    def _logits(self, x: torch.Tensor, t0: float) -> torch.Tensor:
        if self.keep_hidden:  # the final norm's rows [M, H], for MTP drafts (mtp.py)
            self.hidden = x
        logits = self.lm_head(x)  # [M, V]
        if self.desc.scales.logits != 1.0:  # Granite's logits scaling
            logits = logits / self.desc.scales.logits
        self.executor.end_forward(t0)
        self.steps += 1
        return logits

