"""The executor's CPU paths that take a layer's routed pairs in one kernel call per tier (transformers' silu gate on a
concatenated gate|up, no biases, no post-expert norm), with the same numbers as the per-expert path.

    per tier (hits, fetched chunks, host misses, the disk tier's reads as they land): bf16 --> moe_experts_bf16;
        int8/fp8/mxfp4/ggml --> moe_experts_q (the fused-experts entries, kernels/ops.py)        (forward)
        an expert with more than KERNEL_MAX_GROUP tokens (prefill) --> expert_forward's GEMM

Legend: T tokens, K top-k, H hidden, S = T*K routed pairs; a group g = (expert, first sorted pair, count).
"""

from __future__ import annotations

import time

import torch

from moe_offload.engines.offload.experts import tiering
from moe_offload.engines.offload.kernels import dispatch, jit
from moe_offload.engines.offload.kernels.dispatch import expert_forward
from moe_offload.engines.offload.kernels.ops import experts, token_pairs


def kind(state, module, x) -> str | None:
    """Which one-call kernel takes this layer's pairs on the CPU: "bf16" (moe_experts_bf16), "q" (moe_experts_q) or
    None (the per-expert path); decided once per layer and kind of input (dispatch's checks)."""
    key = (x.dtype, x.dim(), x.device.type, jit.load(), torch.is_grad_enabled() and x.requires_grad)
    k = state.fused.get(key, False)
    if k is False:
        w = state.store.tensors[0]
        k = "bf16" if dispatch.fused_experts_ok(module, w, x) and _biases_ok(state) else (
            "q" if dispatch.fused_experts_q_ok(module, w, x) else None)
        state.fused[key] = k
    return k


def _biases_ok(state) -> bool:
    """The experts' biases, where they have them, are both there and bf16 (what moe_experts_bf16 reads)."""
    b = list(state.store.tensors[2:4])
    return all(t is None for t in b) or all(t is not None and t.dtype == torch.bfloat16 for t in b)


def gate_args(module, weights) -> tuple:
    """The fused-experts entries' trailing arguments (moe_experts_bf16 / moe_experts_q) for these experts' (up, down,
    up_bias, down_bias, ..) tuples: (gate_up biases or None, down biases or None, gate, alpha, limit)."""
    biased = weights and weights[0][2] is not None
    return ([w[2] for w in weights] if biased else None, [w[3] for w in weights] if biased else None,
            *dispatch.fused_gate(module))


def q_args(weights) -> tuple[list, list, list, list]:
    """moe_experts_q's per-expert lists (gate_ups, their scales, downs, their scales) from slot or store tuples (up,
    down, up_bias, down_bias, up_scale, down_scale)."""
    return ([w[0] for w in weights], [dispatch.scale_arg(w[4]) for w in weights],
            [w[1] for w in weights], [dispatch.scale_arg(w[5]) for w in weights])


def forward(ex, state, module, hidden_states, top_k_index, top_k_weights, perm, hits, fetch, host, quantized=False):
    """Each tier's pairs through one kernel call, written straight into their (token, k) rows. bf16:
    moe_experts_bf16; int8/fp8/ggml blocks (``quantized``): moe_experts_q (an expert with more than KERNEL_MAX_GROUP
    tokens goes through expert_forward)."""
    T, K = top_k_index.shape
    cache = state.cache
    x = hidden_states.contiguous() if quantized else hidden_states.to(torch.bfloat16).contiguous()  # [T, H]
    if T == 1:  # groups are (expert, k, 1): pair s = k
        tok, perm = token_pairs(K)[:2]
    else:
        tok = perm // K  # [S] token of each expert-sorted pair
    proj = (torch.empty if ex.ep is None else torch.zeros)(T * K, x.shape[1], dtype=x.dtype)  # [S, H] by (token, k)

    def each(groups, weights):  # one expert at a time through expert_forward (torch's GEMM)
        for (_, start, n), w in zip(groups, weights):
            y = expert_forward(module, x.index_select(0, tok[start : start + n]), *w)
            proj.index_copy_(0, perm[start : start + n], y.to(proj.dtype))

    def run(groups, weights, quantized=quantized):
        if not groups:
            return
        # an expert with more than KERNEL_MAX_GROUP tokens (prefill) goes through torch's GEMM, faster there
        # than the few-token dot kernel (dispatch.KERNEL_MAX_GROUP says why 16); the rest in one call
        small = [i for i, g in enumerate(groups) if g[2] <= dispatch.KERNEL_MAX_GROUP]
        if small:
            ws = [weights[i] for i in small]
            ups, up_s, downs, down_s = q_args(ws) if quantized else ([w[0] for w in ws], None, [w[1] for w in ws], None)
            experts(x, ups, downs, tok, perm, [groups[i][1] for i in small], [groups[i][2] for i in small], proj, up_s,
                    down_s, *gate_args(module, ws))
        big = [i for i, g in enumerate(groups) if g[2] > dispatch.KERNEL_MAX_GROUP]
        each([groups[i] for i in big], [weights[i] for i in big])

    t1 = time.perf_counter()
    run([g for g, _ in hits], [cache.weights[s] for _, s in hits])
    t2 = time.perf_counter()
    # fetched experts in chunks of the dynamic slot count: a later fetch must not evict one not yet computed
    fetch_s = 0.0
    for i in range(0, len(fetch), max(cache.dynamic, 1)):
        chunk = fetch[i : i + max(cache.dynamic, 1)]
        slots = [cache.fetch(g[0], copy_sync, state.store.expert(g[0])) for g in chunk]
        tc = time.perf_counter()
        run(chunk, [cache.weights[s] for s in slots])
        fetch_s += time.perf_counter() - tc
    t3 = time.perf_counter()
    if hasattr(state.store, "request"):  # host slots over the disk tier: misses read while the rest computes
        tiering.run_host(state.store, host, run)
    elif state.cold is not None:  # APPROXIMATE: misses from the lower-precision copy, through the quantized kernels
        cold = [state.cold.expert(g[0]) for g in host]
        if _cold_q(state, module, x):
            run(host, cold, quantized=True)
        else:
            each(host, cold)
    else:
        run(host, [state.store.expert(g[0]) for g in host])
    t4 = time.perf_counter()
    result = ex.combine(state, proj, hidden_states, top_k_index, top_k_weights, hits, host, len(fetch))
    ex.book_stages(t1, t2, t3, t4, fetch_s)
    return result


def _cold_q(state, module, x) -> bool:
    """The layer's cold copy goes through the quantized one-call kernels (checked once per input kind)."""
    key = ("cold", x.dtype, x.dim())
    if key not in state.fused:
        state.fused[key] = dispatch.fused_experts_q_ok(module, state.cold.tensors[0], x)
    return state.fused[key]


def copy_sync(slot, dst, src):
    """A slot's tensors from the store's, on the host (no stream, no event)."""
    for d, s in zip(dst, src):
        if d is not None:
            d.copy_(s)
