"""The fused decode path's whole-step call: every layer of a decode step in one C++ call when every expert is resident.

    DecodePlan.forward --(eligible step)--> StepCall.run(h, cos, sin, table, lens)
      --> moe_offload::DecodeStep.step (kernels/csrc/cpu/step.cpp: per layer decode_layer_bf16, the routed experts
          through moe_experts_q | moe_experts_bf16, the combine; then the final norm)
      --> (x [M, H], routes [L, M, K], experts seconds) --> Executor.book_resident (hits, stage time, captured routes)

Why: with every expert resident the executor has nothing to decide per layer (no tier, no fetch, no eviction), yet
its Python glue and two op calls of ~40 arguments cost a few hundred microseconds per layer while the second core
waits; one call per step leaves only the bookkeeping, done once from the returned routes.

When (else the per-layer loop runs, with the same numbers): a CPU executor, every layer's MoE block with its router
fused (and a shared expert only where shared_expert_bf16 takes it: Qwen2-MoE's) or DeepSeek-V3's block (moe_blocks.py:
grouped sigmoid router, shared experts as one silu MLP; GLM-4.5+, dots.llm1), every dense layer a silu MLP (mlp_rows),
no block run as its module, every expert pinned (fraction 1.0 or a placement pinning
all) and, over the expert store file, held in a host slot that is never evicted and already read in (until the
background reads land, the loop runs and waits for what it routes to), experts the one-call kernels take
(experts/fused.kind: "bf16" or "q"), top-k <= 16, at most KERNEL_MAX_GROUP tokens, not the load-time probe (dry).
MOE_OFFLOAD_DECODE_STEP=0 keeps the per-layer loop.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload import switches
from moe_offload.engines.offload.experts import fused
from moe_offload.engines.offload.experts.tiercache import TierSlots
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.log import get_logger

log = get_logger("moe_offload.fastpath")

ENV = "MOE_OFFLOAD_DECODE_STEP"


class StepCall:
    """A built moe_offload::DecodeStep and the executor states it books for."""

    def __init__(self, obj, executor, states):
        self.obj, self.executor, self.states = obj, executor, states
        self.reading = [st.store for st in states if hasattr(st.store, "pending")]  # host slots over the store file
        self.broken = False  # a background read failed: its slot no longer holds the expert
        self.calls = 0

    @classmethod
    def build(cls, plan) -> "StepCall | None":
        """The whole-step call for ``plan`` (a fastpath.DecodePlan), or None where the per-layer loop must run. Never
        raises: weights the call's checks refuse mean the loop."""
        try:
            return cls._build(plan)
        except (RuntimeError, TypeError, ValueError) as e:
            log.info("whole-step decode off: the per-layer loop runs", reason=f"{type(e).__name__}: {e}")
            return None

    @classmethod
    def _build(cls, plan) -> "StepCall | None":
        why = cls._refuse(plan)
        if why:
            log.debug("whole-step decode off", reason=why)
            return None
        fam, hd = plan.family, plan.head_dim
        obj = torch.classes.moe_offload.DecodeStep(plan.bs, fam.router_weights_bf16, fam.norm_mode, fam.router_mode)
        probe = torch.empty(1, plan.model.config.hidden_size, dtype=torch.bfloat16)
        for lay in plan.layers:
            (ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn), (scaling, window, wo, bo, ln2) = lay.args
            kp, vp = plan.pool.layer_of(lay.idx, wk.shape[0] // hd, hd, wv.shape[0] // hd, hd, torch.bfloat16)
            ups, up_s, downs, down_s, q, top_k = [], [], [], [], False, lay.top_k
            if lay.state is not None:
                kind = fused.kind(lay.state, lay.experts, probe)
                if kind is None:
                    log.debug("whole-step decode off", reason=f"layer {lay.idx}: experts the one-call kernels do not take")
                    return None
                cache = lay.state.cache
                ups, up_s, downs, down_s = fused.q_args([cache.weights[cache.slot_of[e]] for e in range(cache.num_experts)])
                q = kind == "q"
                up_s, down_s = (up_s, down_s) if q else ([], [])
                if lay.block is not None:
                    top_k = lay.block.args[2]
            obj.add_layer(ln1, eps, wq, wk, wv, bq, bk, bv, qn, kn, kp, vp, scaling, window, wo, bo, ln2, lay.router,
                          top_k, lay.norm_topk, lay.sinks, lay.router_bias, *lay.scales, ups, up_s, downs, down_s, q,
                          *(lay.shared_args or (None, None, None)))
            if lay.block is not None:  # DeepSeek-V3's block: its router, then its shared experts
                obj.grouped_router(*lay.block.router_args())
            mlp = lay.dense if lay.state is None else getattr(lay.block, "shared_args", None)
            if mlp is not None:
                obj.mlp(*mlp)
        log.info("whole-step decode on", layers=len(plan.layers))
        return cls(obj, plan.executor, [lay.state for lay in plan.layers if lay.state is not None])

    @staticmethod
    def _refuse(plan) -> str:
        if not switches.on(ENV):
            return f"{ENV}=0"
        ex = plan.executor
        if ex.device.type != "cpu":
            return "not a CPU executor"
        for lay in plan.layers:
            if lay.state is None:
                if lay.dense is None:
                    return f"layer {lay.idx}: a dense MLP the kernel does not take"
                continue
            if lay.moe is not None:
                if lay.shared is not None and lay.shared_args is None:
                    return f"layer {lay.idx}: a shared expert the kernel does not take"
            elif lay.block is None or lay.block.shared_args is None:
                return f"layer {lay.idx}: a MoE block run as its module"
            cache = lay.state.cache
            if len(cache.pinned) != cache.num_experts:
                return f"layer {lay.idx}: not every expert pinned"
            if isinstance(lay.state.store, TierSlots) and lay.state.store.dynamic:
                return f"layer {lay.idx}: host slots over the store file that evict"
        return ""

    def takes(self, tokens: int) -> bool:
        return tokens <= dispatch.KERNEL_MAX_GROUP and not self.executor.dry and self._read_in()

    def _read_in(self) -> bool:
        """Every host slot over the store file holds its expert. Background reads that have all landed are settled
        here (without waiting); a failed one raises its error, as the per-layer loop would, and turns this call off."""
        if self.broken:
            return False
        for store in self.reading:
            if store.pending:
                if not all(f.done() for f in list(store.pending.values())):
                    return False
                try:
                    store.settle(list(range(store.num_experts)))
                except BaseException:
                    self.broken = True
                    raise
        return True

    def run(self, h, cos, sin, table, lens, norm, eps) -> torch.Tensor:
        """One decode step through every layer; returns the final norm's output [M, H] and books the routes."""
        x, ids, experts_s = self.obj.step(h, cos, sin, table, lens, norm, eps)
        self.calls += 1
        self.executor.book_resident(self.states, ids, experts_s)
        return x
