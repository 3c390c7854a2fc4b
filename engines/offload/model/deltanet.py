"""Gated-DeltaNet layers (Qwen3-Next's and Qwen3.5's linear attention: the registry's families with
``linear="gated_deltanet"``, control/families.py): their per-sequence state in the paged engine, and a token's decode step in one kernel call instead of ~70 torch ops.

    layer(hidden [1, N, H], cache=kv.PagedCache) (the paged engine: the step's sequences packed)
      -> decode rows (one token of a sequence with a past), bf16 on the CPU with the kernels:
           in_proj_qkvz, in_proj_ba (Qwen3.5: in_proj_qkv|z, in_proj_b|a) over those rows
           -> moe_offload::gated_delta_decode_bf16 on the pool's seats
           (kernels/csrc/cpu/deltanet.cpp: conv update, gated delta rule, gated RMSNorm) -> out_proj
      -> every other sequence's rows (a prefill chunk; any row in fp32 or without kernels): the module's own forward
         on that sequence alone, with a SeatCache over its seat (a fresh state when the chunk starts the sequence)
    layer(hidden [B, 1, H], cache=a transformers cache) (the per-sequence engine): the kernel on the cache's own
      tensors for a cached bf16 one-token step, else the module's forward
    probe (kv_budget.probe_kv_bytes): the layer reports the bytes of its per-sequence state and runs without a cache
    the fused decode path (fastpath.py): LinearLayer.step, the whole decoder layer (norms, projections, this step,
      out_proj, the router) in one moe_offload.Layer.decode_linear call on the pool's seats

The states live in kv.KVPool.states_of: per layer a conv window [seats, C, K] (the model's dtype) and a recurrent
state [seats, Hv, Dk, Dv] (fp32, as the module's rule keeps it); a sequence's seat is taken at its first chunk and
freed when it finishes or is preempted (the scheduler's release).

Why: without it a hybrid model ran one forward per sequence on transformers' cache (its batched throughput was
0.07x llama.cpp's), and a decode step spent a quarter of its time in the layer's small ops. Which layers: the
``linear_attn`` of every decoder layer of a family the registry names gated_deltanet (tests/engines/offload/
test_family_registry.py checks those layers' source and helpers). Exactness: the module path is the module's own
code on the same state; the kernel follows the module's dtypes and element-wise operation order, its reductions over a
head's dims are ordered differently, so outputs agree to bf16 rounding (tests/engines/offload/kernels/
test_deltanet.py).
Legend: N step tokens, B sequences, C conv channels, K conv taps, Hv value heads, Dk / Dv head dims.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from moe_offload.engines.offload.kernels import dispatch, ops
from moe_offload.engines.offload.runtime import kv


def install(model: torch.nn.Module, linear: str) -> int:
    """Give every gated-DeltaNet layer of ``model`` this forward when the family's linear-attention kind (``linear``,
    from the registry) is gated_deltanet; returns how many layers (0: none)."""
    if linear != "gated_deltanet":
        return 0
    layers = [m.linear_attn for m in model.modules() if isinstance(getattr(m, "linear_attn", None), torch.nn.Module)]
    n = 0
    for m in layers:
        if isinstance(m.__dict__.get("forward"), functools.partial):  # installed before (a second engine)
            n += 1
        elif getattr(m, "activation", None) == "silu":
            m._moe_offload_plain = hasattr(m, "in_proj_qkv")  # Qwen3.5's separate projections, else Qwen3-Next's
            # the kernel's fp32 constants, once (A_log.float() and dt_bias as the module promotes them; conv bias)
            m._moe_offload_fp32 = (m.A_log.detach().float(), m.dt_bias.detach().float(),
                                   None if m.conv1d.bias is None else m.conv1d.bias.detach().float())
            m.forward = functools.partial(_forward, m, m.forward)
            n += 1
    return n


def _kernel_takes(layer, x: torch.Tensor) -> bool:
    from moe_offload.engines.offload.kernels import jit

    return (x.dtype == torch.bfloat16 and x.is_cpu and layer.conv1d.weight.dtype == torch.float32
            and layer.norm.weight.dtype == torch.bfloat16 and jit.load())


def _kernel(layer, x: torch.Tensor, conv_state, state, slots=None) -> torch.Tensor:
    """The kernel's step for rows x [B, H]: the out_proj's output [B, H]; conv_state / state updated in place."""
    B, conv, plain = x.shape[0], layer.conv1d, layer._moe_offload_plain
    c = dispatch.call  # the projections' rows on the kernels (the module path patched them alike)
    if plain:  # Qwen3.5: [q | k | v | z], [b | a]
        qkvz = torch.cat([c(layer.in_proj_qkv, x), c(layer.in_proj_z, x)], dim=-1)
        ba = torch.cat([c(layer.in_proj_b, x), c(layer.in_proj_a, x)], dim=-1)
    else:
        qkvz = c(layer.in_proj_qkvz, x).reshape(B, -1).contiguous()
        ba = c(layer.in_proj_ba, x).reshape(B, -1).contiguous()
    a_log, dt_bias, conv_bias = layer._moe_offload_fp32
    out = ops.gated_delta_decode(
        qkvz, ba, conv_state, conv.weight.squeeze(1), conv_bias, state,
        a_log, dt_bias, layer.norm.weight, float(layer.norm.variance_epsilon),
        layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, slots, plain)
    return c(layer.out_proj, out)


def _forward(layer, module_forward, hidden_states, cache=None, attention_mask=None, **kwargs):
    """The layer's forward (see the module docstring)."""
    if isinstance(cache, kv.PagedCache):
        return _paged(layer, module_forward, hidden_states, cache)
    if (cache is not None and hidden_states.dim() == 3 and hidden_states.shape[1] == 1
            and _kernel_takes(layer, hidden_states) and not cache.is_recording_past(layer.layer_idx)):
        cs = cache.get_conv_state(layer.layer_idx, state_idx=0)
        rs = cache.get_recurrent_state(layer.layer_idx, state_idx=0)
        if (cs is not None and rs is not None and cs.dtype == torch.bfloat16 and rs.dtype == torch.float32
                and cs.is_contiguous() and rs.is_contiguous() and cs.shape[-1] == layer.conv_kernel_size):
            x = sys.modules[type(layer).__module__].apply_mask_to_padding_states(hidden_states, attention_mask)
            return _kernel(layer, x[:, 0], cs, rs).unsqueeze(1)
    return module_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


def _state_layout(layer, dtype) -> tuple[tuple, tuple]:
    """(shapes, dtypes) of the layer's per-sequence states: the conv window [C, K] in the model's dtype, the recurrent
    state [Hv, Dk, Dv] in fp32."""
    return (((layer.conv_dim, layer.conv_kernel_size), (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)),
            (dtype, torch.float32))


def _seat_pools(pool: kv.KVPool, layer, dtype, seats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (conv window, recurrent state) pools, [capacity >= seats, ...] each (kv.KVPool.states_of)."""
    return pool.states_of(layer.layer_idx, *_state_layout(layer, dtype), seats)


class DeltaNetBlock:
    """A gated-DeltaNet layer on the owned graph (graph.py): the rows of a step [N, H] -> [N, H], the step's layout
    passed in. Decode rows take the kernel on the pool's seats; a prefill chunk runs the module's own forward on its
    sequence's seat (the chunked delta rule is the module's: transformers' code, its weights)."""

    def __init__(self, layer):
        self.layer = layer
        fwd = layer.__dict__.get("forward")
        self.module_forward = fwd.args[1] if isinstance(fwd, functools.partial) else layer.forward  # install()'s

    def __call__(self, x: torch.Tensor, rot, step: kv.StepContext, cache: kv.PagedCache) -> torch.Tensor:
        return _paged(self.layer, self.module_forward, x.unsqueeze(0), cache, step)[0]


def _paged(layer, module_forward, hidden_states, cache: kv.PagedCache, step: kv.StepContext | None = None
           ) -> torch.Tensor:
    """The paged engine's step: hidden_states [1, N, H] packed by sequence (kv.StepContext.seqs); ``step`` the
    step's layout (the graph passes it; the modules' path finds it on the thread)."""
    step = step if step is not None else kv.current()
    if step.probe:
        shapes, dtypes = _state_layout(layer, hidden_states.dtype)
        cache.stateful[layer.layer_idx] = sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                                              for s, d in zip(shapes, dtypes))
        return module_forward(hidden_states, cache=None)
    pool = cache.pool
    seqs = step.seqs
    conv_pool, state_pool = _seat_pools(pool, layer, hidden_states.dtype, max(s.seat for s in seqs) + 1)
    h = hidden_states[0]  # [N, H]
    out = torch.empty_like(h)
    rest = seqs
    if _kernel_takes(layer, h):
        decode = [s for s in seqs if s.q_len == 1 and s.ctx_len > 1]
        if decode:
            rows = torch.tensor([s.q_start for s in decode], device=h.device)
            slots = torch.tensor([s.seat for s in decode], device=h.device)
            out.index_copy_(0, rows, _kernel(layer, h.index_select(0, rows), conv_pool, state_pool, slots))
            rest = [s for s in seqs if not (s.q_len == 1 and s.ctx_len > 1)]
    for s in rest:
        seat = SeatCache(layer.layer_idx, conv_pool[s.seat : s.seat + 1], state_pool[s.seat : s.seat + 1],
                         fresh=s.ctx_len == s.q_len)
        x = h[s.q_start : s.q_start + s.q_len].unsqueeze(0)  # [1, q, H]
        out[s.q_start : s.q_start + s.q_len] = module_forward(x, cache=seat)[0]
    return out.unsqueeze(0)


class LinearLayer:
    """A covered gated-DeltaNet layer as the fused decode path calls it (a kernel layer's .linear and .output)."""

    def __init__(self, m: torch.nn.Module, args: tuple, out: tuple):
        self.m, self.args, self.out = m, args, out  # Layer.linear's arguments; Layer.output's (wo, None, so)

    @classmethod
    def of(cls, m: torch.nn.Module) -> "LinearLayer | None":
        """The layer ``m`` (installed by ``install``) as Layer.decode_linear takes it, or None: projections with a bias,
        bf16 beside int8 / ggml blocks, a conv or norm of other dtypes."""
        from moe_offload.engines.offload.loading.quant import RowsLinear

        if not isinstance(m.__dict__.get("forward"), functools.partial):
            return None
        plain = m._moe_offload_plain
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if plain else ("in_proj_qkvz", "in_proj_ba")
        projs = [getattr(m, n) for n in names]
        every = projs + [m.out_proj]
        if any(p.bias is not None for p in every) or m.conv1d.weight.dtype != torch.float32 or \
                m.norm.weight.dtype != torch.bfloat16:
            return None
        if all(type(p) is torch.nn.Linear and p.weight.dtype == torch.bfloat16 for p in every):
            w_in, s_in, wo, so = [p.weight for p in projs], [], m.out_proj.weight, None
        elif all(isinstance(p, RowsLinear) for p in every):
            w_in, s_in = [p.weight_q for p in projs], [p.weight_scale for p in projs]
            wo, so = m.out_proj.weight_q, m.out_proj.weight_scale
        else:
            return None
        n_qkvz = sum(p.out_features for p in projs[: len(projs) // 2])
        a_log, dt_bias, conv_b = m._moe_offload_fp32
        return cls(m, (w_in, s_in, n_qkvz, m.conv1d.weight.squeeze(1), conv_b, a_log, dt_bias, m.norm.weight,
                       float(m.norm.variance_epsilon), [m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim],
                       plain), (wo, None, so))

    def bind(self, k) -> None:
        """Set the kernel layer ``k`` (moe_offload.Layer) to this mixer."""
        k.linear(*self.args)
        k.output(*self.out)

    def states(self, pool: kv.KVPool, seats: list[int], fresh: list[int], dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (conv window, recurrent state) pools for sequences in ``seats``; the seats of ``fresh`` rows
        (their sequence starts at this token) zeroed first: the module's fresh state."""
        conv, state = _seat_pools(pool, self.m, dtype, max(seats) + 1)
        for t in fresh:
            conv[seats[t]].zero_()
            state[seats[t]].zero_()
        return conv, state


class SeatCache:
    """What the module's forward asks of a cache, for one layer and one sequence: its seat's conv window and
    recurrent state (views of the pool's tensors), updated as transformers' linear-attention cache layer updates
    them (the window padded or prefixed, its last K columns kept; the state copied in)."""

    def __init__(self, layer_idx: int, conv: torch.Tensor, state: torch.Tensor, fresh: bool):
        self.layer_idx, self.conv, self.state, self.fresh = layer_idx, conv, state, fresh  # [1, C, K], [1, Hv, Dk, Dv]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.state

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        K = self.conv.shape[-1]
        if self.fresh:  # the sequence's first chunk: left-padded with zeros to the window
            full = conv_states if conv_states.shape[-1] >= K else torch.nn.functional.pad(
                conv_states, (K - conv_states.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv.copy_(full[..., -K:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int = 0, **kwargs) -> torch.Tensor:
        self.state.copy_(recurrent_states)
        self.fresh = False
        return self.state
