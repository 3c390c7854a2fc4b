"""The fused decode paths' whole-step call: every layer of a decode step in one C++ call when every expert is resident.

    DecodePlan.forward --(eligible step)--> StepCall.run(h, cos[], sin[], table, lens, .., seats, states)
                       (gated-DeltaNet layers: seats and their (conv, state) pools)
                       (MLA layers, mla_plan.py: StepCall.run_mla(h, cos, sin, slots, rows, lens))
      --> moe_offload::DecodeStep.step | step_mla (kernels/csrc/cpu/step.cpp: per layer (a moe_offload.Layer) the
          attention half (Layer.decode, decode_linear or decode_mla), the router (fused, or a MoE block's selection
          as moe_blocks.py makes it), the routed experts through moe_experts_q | moe_experts_bf16, the combine, a shared
          expert or a dense layer's MLP; then the final norm)
      --> (x [M, H], routes [L, M, K], experts seconds) --> Executor.book_resident (hits, stage time, captured routes)

Why: with every expert resident the executor has nothing to decide per layer (no tier, no fetch, no eviction), yet
its Python glue and two op calls of ~40 arguments cost a few hundred microseconds per layer while the second core
waits; one call per step leaves only the bookkeeping, done once from the returned routes.

When (else the per-layer loop runs, with the same numbers): a CPU executor; every MoE layer with its router fused
(qwen3_moe, olmoe, mixtral, gpt_oss's biased clamped-SwiGLU experts; a shared expert only where shared_expert_bf16
takes it: Qwen2-MoE's) or a block moe_blocks.py runs (DeepSeek-V3's: GLM-4.5+, dots.llm1, Solar Open, and with MLA
attention DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash; MiniMax-M2's; Ernie 4.5's), its shared experts one silu MLP
(mlp_rows); every dense layer a silu MLP; no block run as its module; every expert pinned (fraction 1.0 or a
placement pinning all) and, over the expert store file, held in a host slot that is never evicted and already read
in (until the background reads land, on every rank under expert parallel, the loop runs and waits for what it routes
to); experts the one-call kernels
take (experts/fused.kind: "bf16" or "q"); top-k <= 16, at most KERNEL_MAX_GROUP tokens, not the load-time probe
(dry). Expert parallel (ranks/parallel.py): each rank's call computes its experts' pairs and sums the rows over
the ranks itself (DecodeStep.ranks), so a rank needs only its own experts pinned.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload.experts import fused
from moe_offload.engines.offload.experts.tiercache import TierSlots
from moe_offload.engines.offload.kernels import dispatch, ops
from moe_offload.engines.offload.loading.quant import RowsLinear
from moe_offload.engines.offload.model.weights import decoder
from moe_offload.log import get_logger

log = get_logger("moe_offload.fastpath")


def _guarded(build, plan):
    """``build(plan)``, or None (logged) where the kernels' checks refuse the weights: the per-layer loop runs. Under
    expert parallel the ranks agree: the call is built on every rank or on none, so every rank takes the same path
    (a rank whose build raised agrees first, then raises: the others never wait for it)."""
    call, err = None, None
    try:
        call = build(plan)
    except (RuntimeError, TypeError, ValueError) as e:
        log.info("whole-step decode off: the per-layer loop runs", reason=f"{type(e).__name__}: {e}")
    except Exception as e:  # raised once the ranks agreed
        err = e
    if plan.executor.ep is not None:
        from moe_offload.engines.offload.ranks.parallel import agree

        if not agree(call is not None) and call is not None:
            log.info("whole-step decode off: the per-layer loop runs", reason="another rank cannot build the call")
            call = None
    if err is not None:
        raise err
    return call


class StepCall:
    """A built moe_offload::DecodeStep and the executor states it books for."""

    def __init__(self, obj, executor, states):
        if executor.ep is not None:  # expert parallel: this rank's pairs, the rows summed over the ranks in the call
            from moe_offload.engines.offload.ranks.parallel import step_group

            obj.ranks(step_group(), *executor.ep)
        self.obj, self.executor, self.states = obj, executor, states
        self.reading = [st.store for st in states if hasattr(st.store, "pending")]  # host slots over the store file
        self.broken = False  # a background read failed: its slot no longer holds the expert
        self.ready = not self.reading  # every host slot read in (expert parallel: on every rank)
        self.calls = 0

    @classmethod
    def build(cls, plan) -> "StepCall | None":
        """The whole-step call for ``plan`` (a fastpath.DecodePlan), or None where the per-layer loop must run. Never
        raises: weights the call's checks refuse mean the loop."""
        return _guarded(cls._build, plan)

    @classmethod
    def _build(cls, plan) -> "StepCall | None":
        def glue_ok(lay) -> bool:  # the router fused (+ a shared expert the kernel takes), or DeepSeek-V3's block
            if lay.moe is not None:
                return lay.shared is None or lay.shared_args is not None
            return lay.block is not None and (lay.block.shared_args is not None or lay.block.shared is None)

        items = [(lay.idx, lay.state, glue_ok(lay), lay.dense) for lay in plan.layers]
        why = _refuse(plan.executor, items) or next(
            (f"layer {i}: attention projections not all the patched bf16 linears" for i, layer in
             enumerate(decoder(plan.model).layers) if plan.mla and not _mla_linears_ok(layer.self_attn)), "")
        if why:
            log.debug("whole-step decode off", reason=why)
            return None
        obj = ops.decode_step()
        probe = torch.empty(1, plan.model.config.get_text_config().hidden_size, dtype=torch.bfloat16)
        for lay in plan.layers:
            if not _add_experts(lay.kernel, lay.state, lay.experts, probe, lay.idx):
                return None
            if lay.shared_args is not None:
                lay.kernel.shared(*lay.shared_args)
            if lay.linear is None and not plan.mla:  # the index of its table in the step's list (plan.rotaries)
                lay.kernel.rotary_table(plan.rotaries.index(lay.rotary))
            _add_mlp(lay.kernel, lay.block, lay.dense if lay.beside is None else lay.beside)
            obj.add(lay.kernel)
        log.info("whole-step decode on", layers=len(plan.layers), attention=plan.desc.attention)
        return cls(obj, plan.executor, [lay.state for lay in plan.layers if lay.state is not None])

    def takes(self, tokens: int) -> bool:
        """Whether this step runs in the call. The token count and dry are the same on every rank; under expert
        parallel the ranks agree each step until every rank's reads are in (_read_in), then never again."""
        return tokens <= dispatch.KERNEL_MAX_GROUP and not self.executor.dry and self._read_in()

    def _read_in(self) -> bool:
        """Every host slot over the store file holds its expert. Background reads that have all landed are settled
        here (without waiting: meanwhile the per-layer loop runs and waits for what it routes to); a failed one raises
        its error, as the per-layer loop would, and turns this call off."""
        if self.broken:
            return False
        if not self.ready:
            done = all(f.done() for store in self.reading for f in list(store.pending.values()))
            if self.executor.ep is not None:
                from moe_offload.engines.offload.ranks.parallel import agree

                done = agree(done)
            if not done:
                return False
            self.ready = True
            for store in self.reading:
                try:
                    store.settle(list(range(store.num_experts)))
                except BaseException:
                    self.broken = True
                    raise
        return True

    def run(self, h, cos: list, sin: list, table, lens, norm, eps, seats=None, states=()) -> torch.Tensor:
        """One decode step through every layer (cos[i], sin[i]: the i-th of plan.rotaries; gated-DeltaNet layers:
        seats [M] int64 and their (conv, state) pools in layer order); returns the final norm's output [M, H] and
        books the routes."""
        return self._book(*self.obj.step(h, cos, sin, table, lens, norm, eps, seats, list(states)))

    def run_mla(self, h, cos, sin, slots, rows, lens, norm, eps) -> torch.Tensor:
        """run() for an MLA model: slots [M] the tokens' pool rows, rows [M * lmax] each sequence's
        (mla_plan.step_rows)."""
        return self._book(*self.obj.step_mla(h, cos, sin, slots, rows, lens, norm, eps))

    def _book(self, x, ids, experts_s) -> torch.Tensor:
        self.calls += 1
        self.executor.book_resident(self.states, ids, experts_s)
        return x


def _refuse(executor, items) -> str:
    """Why the call cannot run a model of ``items``: (layer, its experts' executor state or None, its MoE block's glue
    is the kernels' (a shared expert they take, the router fused or DeepSeek-V3's), a dense layer's mlp_rows args)."""
    if executor.device.type != "cpu":
        return "not a CPU executor"
    for idx, state, glue_ok, dense in items:
        if state is None:
            if dense is None:
                return f"layer {idx}: a dense MLP the kernel does not take"
            continue
        if not glue_ok:
            return f"layer {idx}: a MoE block (or its shared expert) run as its module"
        if state.cache.pinned_weights(getattr(executor, "ep", None)) is None:
            return f"layer {idx}: not every expert pinned"
        if isinstance(state.store, TierSlots) and state.store.dynamic:
            return f"layer {idx}: host slots over the store file that evict"
    return ""


def _add_experts(k, state, experts, probe, idx: int) -> bool:
    """Give the kernel layer ``k`` its experts by id (none for a dense layer), their biases and gate (gpt-oss's); False
    (logged) where the one-call kernels do not take them."""
    if state is None:
        return True
    kind = fused.kind(state, experts, probe)
    if kind is None:
        log.debug("whole-step decode off", reason=f"layer {idx}: experts the one-call kernels do not take")
        return False
    weights = state.cache.pinned_weights(state.executor.ep)
    ups, up_s, downs, down_s = fused.q_args(weights)
    k.experts(ups, up_s if kind == "q" else [], downs, down_s if kind == "q" else [], kind == "q")
    ub, db, gate, alpha, limit = fused.gate_args(experts, weights)
    if ub is not None or gate:
        k.expert_gate(ub or [], db or [], "clamped_swiglu" if gate else "silu", alpha, limit)
    return True


def _add_mlp(k, block, dense) -> None:
    """The kernel layer's DeepSeek-V3 router and shared experts (block), or its dense MLP or the ungated shared expert
    beside its fused router (``dense``: mlp_rows' args; the call adds it to the routed experts' rows)."""
    if block is not None:
        k.grouped_router(*block.router_args())
    mlp = dense if block is None else block.shared_args
    if mlp is not None:
        k.mlp(*mlp)


def _mla_linears_ok(a) -> bool:
    """The MLA attention's linears the call computes as their modules do: q (q_b_proj | q_proj), o_proj and (without
    q_lora: q_a|kv_a run fused, not as modules) kv_a_proj_with_mqa, each a bf16 nn.Linear patched to the kernels or
    (--dense-dtype int8, a GGUF file) int8 rows / ggml blocks, which call gemv_q."""
    ms = (a.q_b_proj, a.o_proj) if a.q_lora_rank is not None else (a.q_proj, a.o_proj, a.kv_a_proj_with_mqa)
    return all(dispatch.on_kernels(m) or isinstance(m, RowsLinear) for m in ms)
