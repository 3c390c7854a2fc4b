"""The owned graph's blocks (graph.py builds a model out of them): what one decoder layer computes, as torch ops on
the rows of a step, each block holding the weights it reads, bound by name once.

    x [N, H] --rms_norm(kind)--> AttentionBlock: q/k/v (+ biases), q/k norms (per head | over the projection),
        rotary (rotate_half | partial | halves | interleaved_fp32 | none), the paged KV cache (kv.PagedCache.update:
        the step's rows in, its sequences' context out), kv.attend (window, sinks; the step passed in), o_proj
      --rms_norm(kind)--> MoEBlock: SoftmaxRouter (softmax over experts then top-k, or top-k logits then softmax;
        renormalise, weights' dtype) or a MoE block's selection (moe_blocks.RouterBlock: sigmoid, correction bias,
        groups, scale) -> the offload executor (tiers, fetches, statistics) (+ a shared expert, gated or not)
      | MLP: silu(x . gate) * (x . up) -> down

The linears are the modules' weights on the kernels (dispatch.bound: bf16 CPU rows through the GEMV / GEMM kernels,
else the module): no module is patched.

N rows of the step (any mix of prefill chunks, decode rows and draft rows), H hidden, Hq/Hkv query/KV heads,
D head dim, E experts, K top-k. Every op is the one the family's own module computes, in the same order and dtype,
so fp32 logits equal transformers' and bf16 ones round where its modules round (tests/engines/offload/model/
test_graph.py). Nothing here runs a transformers module or reads one's source: the description (control/
description.py) says what each block computes; the modules are only where the weights are found.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_offload.control.description import Attention, Router
from moe_offload.engines.offload.kernels.dispatch import bound
from moe_offload.engines.offload.model import mla
from moe_offload.engines.offload.runtime import kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str) -> torch.Tensor:
    """RMSNorm of the rows of x as each norm kind of description.NormKind rounds it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms":
        return weight * h.to(x.dtype)
    if kind == "rms_fp32_scale":
        return (weight * h).to(x.dtype)
    return (h * (1.0 + weight.float())).type_as(x)  # rms_one_plus


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:  # (2j, 2j+1) -> (-x[2j+1], x[2j])
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kind: str) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, 1, D'] (the rotary module's table, as it returns it) per kind."""
    if kind == "rotate_half":
        return (x * cos) + (_rotate_half(x) * sin)
    if kind == "partial":  # the first D' dims rotate, the rest pass
        d = cos.shape[-1]
        r, p = x[..., :d], x[..., d:]
        return torch.cat([(r * cos) + (_rotate_half(r) * sin), p], dim=-1)
    if kind == "halves":  # gpt-oss: cos/sin of D/2 over the two halves
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    # interleaved_fp32 (Ernie 4.5): pair j's angle is the table's first half, in fp32
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    return ((x.float() * c) + (_rotate_pairs(x).float() * s)).to(x.dtype)


class AttentionBlock:
    """Softmax attention over the paged KV cache for the rows of a step (description.Attention)."""

    def __init__(self, attn, desc: Attention, idx: int, norm_kind: str):
        self.q, self.k, self.v, self.o = (bound(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.desc, self.idx, self.hd, self.scaling = desc, idx, int(attn.head_dim), float(attn.scaling)
        self.q_norm, self.k_norm = qk_norms(attn)
        self.norm_kind = norm_kind
        self.sinks = getattr(attn, "sinks", None) if desc.sinks else None

    def _norm(self, norm, t: torch.Tensor) -> torch.Tensor:
        return t if norm is None else rms_norm(t, norm.weight, eps_of(norm), self.norm_kind)

    def __call__(self, x: torch.Tensor, rot: tuple | None, step: kv.StepContext, cache: kv.PagedCache) -> torch.Tensor:
        N, d = x.shape[0], self.desc
        q, k, v = self.q(x), self.k(x), self.v(x)  # [N, Hq*D], [N, Hkv*D] x 2
        gate = None
        if d.output_gate:  # Qwen3-Next: per head [query | gate], a sigmoid gate on the attention's output
            q, gate = torch.chunk(q.view(N, -1, 2 * self.hd), 2, dim=-1)
            q, gate = q.reshape(N, -1), gate.reshape(N, -1)
        if d.qk_norm == "full":  # over the whole projection, before the heads are split (OLMoE, MiniMax-M2)
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        q, k, v = q.view(N, -1, self.hd), k.view(N, -1, self.hd), v.view(N, -1, self.hd)  # [N, heads, D]
        if d.qk_norm == "head":
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        if rot is not None:  # None: NoPE
            cos, sin = rot[:2]
            q, k = rotate(q, cos, sin, d.rotary.kind), rotate(k, cos, sin, d.rotary.kind)
        if d.qk_norm == "head_after_rotary":  # Hunyuan
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        # [1, heads, N, D] as the cache and attention take them
        key, value = cache.update(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), self.idx, step=step)
        out = kv.attend(step, q.transpose(0, 1).unsqueeze(0), key, value, self.scaling, d.window, self.sinks)
        out = out.reshape(N, -1)
        return self.o(out if gate is None else out * torch.sigmoid(gate))  # [N, H]


def qk_norms(attn) -> tuple:
    """An attention module's (q norm, k norm), or Nones: ``q_norm`` / ``k_norm``, Hunyuan's ``query_layernorm`` /
    ``key_layernorm``."""
    q = getattr(attn, "q_norm", None) or getattr(attn, "query_layernorm", None)
    return q, getattr(attn, "k_norm", None) or getattr(attn, "key_layernorm", None)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary: pairs (2j, 2j+1) by angle j (the table's first half), laid out as halves."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _rotate_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotary: pairs (2j, 2j+1) in fp32 times the complex table (cos + i sin [N, 1, D/2], its real and
    imaginary parts), the result left pair-interleaved and rounded once. The complex product on x viewed [1, heads,
    N, D] with the module's strides: torch rounds (a c - b s, a s + b c) differently in its vectorized and scalar
    complex loops, and the memory layout decides which one runs."""
    xq = x.transpose(0, 1).unsqueeze(0)  # [1, heads, N, D]
    pairs = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    table = torch.complex(cos, sin).transpose(0, 1).unsqueeze(0)  # [1, 1, N, D/2]
    return torch.view_as_real(pairs * table).flatten(3).type_as(x)[0].transpose(0, 1)  # [N, heads, D]


class MLABlock:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) for the rows of a step: the latents
    (kv_lora_rank values, normed, + the shared rotary key) go to the paged cache, kv_b_proj expands the sequences'
    cached latents into every head's key and value, attention, o_proj. Decode-only steps attend over the latents
    with kv_b_proj absorbed instead (mla.py; bf16 ones take the fused call, mla_plan.py: the same cache rows)."""

    def __init__(self, attn, desc: Attention, idx: int, norm_kind: str):
        self.a, self.idx, self.norm_kind = attn, idx, norm_kind
        self.lin = {n: bound(getattr(attn, n)) for n in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                          "kv_b_proj", "o_proj") if getattr(attn, n, None) is not None}
        self.nope, self.rope, self.vd = int(attn.qk_nope_head_dim), int(attn.qk_rope_head_dim), int(attn.v_head_dim)
        self.rank, self.scaling = int(attn.kv_lora_rank), float(attn.scaling)
        self.complex = desc.rotary is not None and desc.rotary.kind == "complex_fp32"  # DeepSeek-V2
        self.interleave = not self.complex and bool(getattr(attn.config, "rope_interleave", False))

    def _norm(self, norm, t: torch.Tensor) -> torch.Tensor:
        return rms_norm(t, norm.weight, eps_of(norm), self.norm_kind)

    def __call__(self, x: torch.Tensor, rot: tuple, step: kv.StepContext, cache: kv.PagedCache) -> torch.Tensor:
        a, N, lin = self.a, x.shape[0], self.lin
        q = lin["q_proj"](x) if a.q_lora_rank is None else lin["q_b_proj"](self._norm(a.q_a_layernorm,
                                                                                      lin["q_a_proj"](x)))
        q_pass, q_rot = torch.split(q.view(N, -1, self.nope + self.rope), [self.nope, self.rope], dim=-1)
        lat, k_rot = torch.split(lin["kv_a_proj_with_mqa"](x), [self.rank, self.rope], dim=-1)  # [N, R], [N, P]
        lat, k_rot = self._norm(a.kv_a_layernorm, lat), k_rot.view(N, 1, self.rope)
        cos, sin = rot[:2]
        if self.complex:
            q_rot, k_rot = _rotate_complex(q_rot, cos, sin), _rotate_complex(k_rot, cos, sin)
        elif self.interleave:
            q_rot, k_rot = _rotate_interleaved(q_rot, cos, sin), _rotate_interleaved(k_rot, cos, sin)
        else:
            q_rot, k_rot = rotate(q_rot, cos, sin, "rotate_half"), rotate(k_rot, cos, sin, "rotate_half")
        # the cache holds the latents: [1, 1, N, R] and [1, 1, N, P] in, the sequences' context [1, 1, X, .] out
        lat_x, rot_x = cache.update(lat.view(1, 1, N, self.rank), k_rot.transpose(0, 1).unsqueeze(0), self.idx,
                                    step=step)
        query = torch.cat([q_pass, q_rot], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, N, N + P]
        if len(rot) > 2:  # Llama 4's query scale per row (Mistral 4), rounded to the query's dtype as the module does
            query = query * rot[2].view(1, 1, N, 1).to(query.dtype)
        if mla.latent_step(step):  # decode rows only: attention over the latents, kv_b_proj absorbed (mla.py)
            return lin["o_proj"](mla.attend(a, step, query, lat_x, rot_x, self.scaling).reshape(N, -1))
        X = lat_x.shape[2]
        kvx = lin["kv_b_proj"](lat_x[0, 0]).view(X, -1, self.nope + self.vd)  # [X, H, N + V]
        k_nope, value = torch.split(kvx, [self.nope, self.vd], dim=-1)
        key = torch.cat([k_nope, rot_x[0, 0].unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)  # [X, H, N + P]
        out = kv.attend(step, query, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                        self.scaling)
        return lin["o_proj"](out.reshape(N, -1))  # [N, H]


class SoftmaxRouter:
    """A softmax router (description.Router without a correction bias or groups): (ids [N, K], weights [N, K])."""

    def __init__(self, gate, r: Router):
        self.weight, self.bias, self.r = gate.weight, getattr(gate, "bias", None), r

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.r
        logits = F.linear(x, self.weight, self.bias if r.logits_bias else None)  # [N, E]
        if r.order == "topk_then_score":  # gpt-oss: the top-k logits, then a softmax over them in their dtype
            top, ids = torch.topk(logits, r.top_k, dim=-1)
            return ids, F.softmax(top, dim=1, dtype=top.dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, r.top_k, dim=-1)  # [N, K]
        if r.renormalise:
            top /= top.sum(dim=-1, keepdim=True)
        return ids, (top.to(logits.dtype) if r.weights_dtype == "model" else top)


class MLP:
    """A silu MLP's (gate_proj, up_proj, down_proj) on the rows x [N, H]."""

    def __init__(self, m):
        self.gate, self.up, self.down = bound(m.gate_proj), bound(m.up_proj), bound(m.down_proj)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ChunkedMLP:
    """A silu MLP with gate|up in one linear (Granite's shared MLP: input_linear [2I, H], output_linear [H, I])."""

    def __init__(self, m):
        self.input, self.output = bound(m.input_linear), bound(m.output_linear)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input(x).chunk(2, dim=-1)
        return self.output(F.silu(gate) * up)


def mlp_of(m) -> MLP | ChunkedMLP:
    return ChunkedMLP(m) if hasattr(m, "input_linear") else MLP(m)


class MoEBlock:
    """Routed experts through the offload executor, + the shared expert (with Qwen2-MoE's sigmoid gate)."""

    def __init__(self, executor, experts, router: SoftmaxRouter, shared=None, shared_gate=None):
        self.executor, self.experts, self.router = executor, experts, router
        self.state = experts._moe_offload
        self.shared = None if shared is None else mlp_of(shared)
        self.shared_gate = None if shared_gate is None else bound(shared_gate)

    @property
    def top_k(self) -> int:
        return self.router.r.top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's part: (ids [N, K], weights [N, K], the rows the experts take)."""
        return (*self.router(x), x)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' rows ``out`` [N, H] + the shared expert's (gated)."""
        if self.shared is None:
            return out
        s = self.shared(x)
        if self.shared_gate is not None:
            s = F.sigmoid(self.shared_gate(x)) * s
        return out + s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights, x = self.route(x)
        return self.finish(x, self.executor.forward(self.state, self.experts, x, ids, weights))


def eps_of(norm) -> float:
    """An RMSNorm's epsilon (``variance_epsilon``; Qwen3-Next's zero-centred norm calls it ``eps``)."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)
