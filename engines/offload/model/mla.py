"""MLA decode the way the fast engines run it: attention over the compressed latent cache, with kv_b_proj's
up-projections absorbed into the query and the output (DeepSeek's inference code, vLLM's and llama.cpp's MLA).

    module path of an MLA layer (transformers): q, latents (kv_a_layernorm), rotary --PagedCache.update-->
      the pool stores the latents: kv_lora_rank + qk_rope_head_dim values per token (kv.py; kvsizes.py prices them)
      --expand_kv--> [decode-only step] the latents unchanged, marked for this layer     (prepare() installs this)
                     [any other step]   kv_b_proj over every cached latent: H full keys and values (the module's own)
      --paged_attention--> [marked] attend(): per head, q_lat = W_uk^T q_nope; softmax((q_lat . lat + q_rot . rope)
                           * scaling); o = W_uv (sum_t p_t lat_t)          (moe_offload::mla_decode_bf16 on the CPU in
                           bf16; the same sums in torch, fp32, elsewhere)
                           [else] attention over the expanded keys (unchanged)
      --o_proj--> ...

Why: expanding is a [L, R] x [R, H*(N+V)] product per layer and step, on top of attention over H full-width keys;
on a DeepSeek-V3-layout model it was two-thirds of a decode step (docs/benchmarks/engine.md). Absorbed, a step reads
kv_b_proj once and R + P values per cached position. Prefill chunks keep the expansion: there the product is a
GEMM over the chunk's rows either way, and absorbed attention does more work per (query, key) pair.

Which modules: every transformers attention module with ``expand_kv`` and ``kv_b_proj`` (DeepSeek-V2/V3, Kimi,
GLM-4.7-Flash, LongCat, MiniCPM3, Mistral 4, ...), except those with a sparse-attention indexer (DeepSeek-V3.2's
DSA: its mask selects keys) or a sliding window.

Numbers: the absorbed sums run in fp32 and round once, where the module path rounds the expanded keys and values to
the model dtype first; fp32 models agree to float rounding (greedy tokens identical in the exactness tests), bf16
within the bf16 tolerance (tests/engines/offload/model/test_mla.py).
Legend: H heads, N/P/V nope/rope/value head dims, R kv_lora_rank, L cached positions, Bd decode sequences.
"""

from __future__ import annotations

import functools

import torch

from moe_offload.engines.offload.kernels import jit, ops
from moe_offload.engines.offload.runtime import kv


def eligible(module) -> bool:
    """An MLA attention module whose decode this file can absorb."""
    need = ("expand_kv", "kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_heads")
    if not all(hasattr(module, a) for a in need) or type(module.kv_b_proj) is not torch.nn.Linear:
        return False
    if getattr(module, "indexer", None) is not None or getattr(module, "sliding_window", None):
        return False
    cfg = getattr(module, "config", None)  # DSA models: some layers reuse another layer's key selection (indexer None)
    if any(getattr(cfg, k, None) is not None for k in ("index_topk", "indexer_types", "index_n_heads")):
        return False
    w = module.kv_b_proj.weight
    return w.shape == (module.num_heads * (module.qk_nope_head_dim + module.v_head_dim), module.kv_lora_rank)


def prepare(model) -> int:
    """Install the absorbed decode on every eligible MLA module of ``model``; returns how many (0 when none).
    Idempotent."""
    n = 0
    for m in model.modules():
        if hasattr(m, "_moe_offload_mla"):  # installed before
            n += 1
        elif eligible(m):
            m.expand_kv = functools.partial(_expand, m, m.expand_kv)  # an instance attribute over the class method
            m._moe_offload_mla = True
            n += 1
    return n


def latent_step(step) -> bool:
    """A step this file absorbs: a real (not probe) paged step where every sequence decodes one token."""
    return step is not None and not step.probe and bool(step.decode) and len(step.decode) == len(step.seqs)


def _expand(module, original, kv_nope, k_rot):
    step = getattr(kv._active, "step", None)
    if latent_step(step) and kv_nope.dim() == 4 and kv_nope.shape[1] == 1 and kv_nope.shape[-1] == module.kv_lora_rank:
        kv._active.latent = functools.partial(attend, module, step)  # paged_attention of this layer takes it
        return kv_nope, k_rot
    return original(kv_nope, k_rot)


def attend(module, step, query, lat, rope, scaling):
    """query [1, H, Bd, N + P] (the module's rotated query), lat [1, 1, X, R], rope [1, 1, X, P] in the step's key
    layout (decode sequences first, each padded to ``step.lmax``) -> [1, Bd, H, V] as the attention function returns."""
    Bd, L = len(step.decode), step.lmax
    nope = module.qk_nope_head_dim
    q = query[0].index_select(1, step.decode_rows).transpose(0, 1).contiguous()  # [Bd, H, N + P]
    lat_r = lat[0, 0, : Bd * L]  # [Bd * L, R]
    rope_r = rope[0, 0, : Bd * L]
    lens = step.decode_lens  # the step's tensor (a captured step's static buffer), else built here
    if lens is None:
        lens = torch.tensor([step.seqs[i].ctx_len for i in step.decode], dtype=torch.long)
    w = module.kv_b_proj.weight
    scale = float(scaling if scaling is not None else (nope + rope.shape[-1]) ** -0.5)
    if q.is_cpu and q.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and jit.load():
        o = ops.mla_decode(q, lat_r.contiguous(), rope_r.contiguous(), lens, w, nope, scale)
    else:
        o = reference(q, lat_r, rope_r, lens.to(q.device), w, nope, scale)
    out = query.new_empty(1, query.shape[2], q.shape[1], o.shape[-1])  # [1, N, H, V]
    out[0].index_copy_(0, step.decode_rows, o)
    return out


def reference(q, lat, rope, lens, w, nope: int, scaling: float) -> torch.Tensor:
    """The absorbed attention in torch, fp32: q [B, H, N + P], lat [B * L, R], rope [B * L, P], lens [B],
    w = kv_b_proj.weight [H * (N + V), R] -> [B, H, V] in q's dtype. What mla_decode_bf16 computes."""
    B, H, _ = q.shape
    R = lat.shape[-1]
    wf = w.float().view(H, -1, R)
    w_uk, w_uv = wf[:, :nope], wf[:, nope:]  # [H, N, R], [H, V, R]
    latf = lat.float().view(B, -1, R)  # [B, L, R]
    ropef = rope.float().view(B, latf.shape[1], -1)  # [B, L, P]
    qf = q.float()
    q_lat = torch.einsum("bhn,hnr->bhr", qf[..., :nope], w_uk)
    s = (torch.einsum("bhr,blr->bhl", q_lat, latf) + torch.einsum("bhp,blp->bhl", qf[..., nope:], ropef)) * scaling
    pos = torch.arange(latf.shape[1], device=q.device)
    s = s.masked_fill((pos[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o_lat = torch.einsum("bhl,blr->bhr", p, latf)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).to(q.dtype)
