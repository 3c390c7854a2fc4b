"""Paged KV cache: one block pool per attention layer, a block table per sequence, and the attention
function that reads them. Memory grows with the sequences, never with the model's full context.

    step tokens, packed [1, N] --model forward--> per attention layer: q [1, Hq, N, D], k/v [1, Hkv, N, D]
      -> PagedCache.update: k/v rows -> pool rows slot_mapping[n]          (pool [blocks * bs, Hkv, D])
      -> paged_attention: decode rows of all sequences in one padded SDPA, each prefill chunk its own
         (causal from its offset), sliding window and attention sinks as the layer asks
      -> [1, N, Hq, Dv]

Legend: N tokens in the step, B sequences, L a context's length, Hq/Hkv query/KV heads, D (Dv) head dim, bs block size.

A quantized cache (``--kv-cache-dtype int8 | fp8``, kv_quant.py): PagedCache.update quantizes the step's new rows and
hands back the dequantized context; the fused decode kernel (decode.cpp) does the same with the same roundings.

The attention implementation is registered with transformers as ``moe_offload_paged``; transformers
then builds no mask (it does not know the name) and every layer's ``cache.update`` lands here. A model
whose layers keep other state (Mamba, linear attention, convolutions) fails the probe in ``probe_paged``
and the engine runs it per sequence with the model's own cache instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moe_offload.engines.offload.kernels import jit, ops
from moe_offload.engines.offload.runtime.kv_quant import dequantize, quantize

ATTENTION = "moe_offload_paged"
_active = threading.local()  # .step: the StepContext of the forward running on this thread


@dataclass
class SeqSlice:
    """One sequence's part of a step: query rows [q_start, q_start + q_len) attend to its context of ctx_len
    positions, found at [k_start, k_start + ctx_len) of the keys ``PagedCache.update`` hands back."""

    q_start: int
    q_len: int
    ctx_len: int
    k_start: int = 0
    seat: int = -1  # the sequence's seat in the pool's per-sequence state (linear attention), KVPool.seat


@dataclass
class StepContext:
    """What every attention layer of one forward needs: where the new rows go, which pool rows to read back
    (``gather``; or ``view`` = (first row, rows) when one sequence holds contiguous rows: no copy), and who
    attends to what. Decode sequences (one query row) come first in the key layout, each padded to ``lmax``."""

    slot_mapping: torch.Tensor | None  # [N] pool row of each new token
    seqs: list[SeqSlice]
    pool: "KVPool | None" = None
    gather: torch.Tensor | None = None  # [X] pool rows of the key layout
    view: tuple[int, int] | None = None
    decode: list[int] = field(default_factory=list)  # indices into seqs with q_len == 1, in key-layout order
    lmax: int = 0
    decode_rows: torch.Tensor | None = None  # [Bd] query rows
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, lmax] bool: real (and in-window) key positions
    decode_pos: torch.Tensor | None = None  # [Bd] each query's position
    decode_lens: torch.Tensor | None = None  # [Bd] each decode sequence's context length (MLA's latent attention)
    probe: bool = False  # shape probe: attend to the step's own rows, store nothing


class KVPool:
    """Blocks of ``block_size`` token rows, shared by every attention layer (layer tensors are created at first
    use from the shapes the layer writes). ``num_blocks`` bounds the memory; ``usage`` is the fraction in use.
    ``codes``: a quantized cache's storage dtype (kv_quant.CACHE_DTYPES), None for rows in the model dtype."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device, seats: int = 0,
                 codes: torch.dtype | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool: expected num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low block ids first
        self.ref = [0] * num_blocks  # sequences holding each block (more than one: a shared cached prefix)
        self.cache = None  # the PrefixCache (prefix_cache.py) when prefix caching is on
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.codes = codes
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # quantized: layer -> (key, value) [rows, heads]
        # layers that keep a fixed-size state per sequence instead of KV rows (linear attention: a convolution window
        # and a recurrent state): one seat per running sequence, each layer's states stacked [seats, ...]
        self.seats: dict[int, int] = {}  # sequence id -> seat
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.max_seats = seats  # the scheduler's max_num_seqs: states are sized for it (budgeted, kv_budget.py)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached free ones and cached ones no sequence holds (evictable)."""
        return len(self._free) + (len(self.cache.evictable) if self.cache is not None else 0)

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each with one reference: free ones first, then the least recently used cached ones."""
        if n > self.free_blocks:
            raise MemoryError(f"KV pool: {n} blocks asked, {self.free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self.cache.evictable.popitem(last=False)
                self.cache.forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (cached blocks a sequence found: prefix_cache.py)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.cache.evictable[b]
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One reference less to each of ``blocks``; a block nobody holds is free, or evictable while cached (the
        last block first, so that a sequence's tail is evicted before its head)."""
        for b in reversed(blocks):
            if self.ref[b] < 1:
                raise RuntimeError(f"KV pool: block {b} freed more often than it was handed out")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.cache is not None and b in self.cache.hash_of:
                    self.cache.evictable[b] = None
                else:
                    self._free.append(b)

    def seat(self, sid: int) -> int:
        """The state seat of sequence ``sid`` (the lowest free one at its first call)."""
        s = self.seats.get(sid)
        if s is None:
            taken = set(self.seats.values())
            s = self.seats[sid] = next(i for i in range(len(taken) + 1) if i not in taken)
        return s

    def release(self, sid: int) -> None:
        """Sequence ``sid`` finished or was preempted: its seat is free (a recompute starts from a fresh state)."""
        self.seats.pop(sid, None)

    def states_of(self, idx: int, shapes: tuple[tuple[int, ...], ...], dtypes: tuple, seats: int) -> tuple[torch.Tensor, ...]:
        """Layer ``idx``'s per-sequence states, one tensor [capacity, *shape] per (shape, dtype), created at first use
        for ``max_seats`` (torch.empty commits no pages: memory grows with the seats written; a sequence's first
        chunk writes its seat before anything reads it) and grown (copied) when ``seats`` exceed the capacity."""
        have = self.states.get(idx)
        if have is None or have[0].shape[0] < seats:
            cap = max(seats, self.max_seats, 2 * have[0].shape[0] if have is not None else 1)
            new = tuple(torch.empty(cap, *shape, dtype=dt, device=self.device) for shape, dt in zip(shapes, dtypes))
            if have is not None:
                for n, o in zip(new, have):
                    n[: o.shape[0]].copy_(o)
            self.states[idx] = have = new
        return have

    def layer(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s pools for the step's new rows k/v [1, Hkv, N, D] (created at first use)."""
        return self.layer_of(idx, k.shape[1], k.shape[3], v.shape[1], v.shape[3], k.dtype)

    def layer_of(self, idx: int, k_heads: int, k_dim: int, v_heads: int, v_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s (key, value) pools [rows, heads, dim], created at first use (the fused path asks by shape);
        a quantized cache's hold codes (``self.codes``), their scales in ``self.scales[idx]``."""
        pools = self.layers.get(idx)
        if pools is None:
            rows = self.num_blocks * self.block_size
            store = self.codes or dtype
            # torch.empty commits no pages: resident memory grows with the rows actually written
            pools = (torch.empty(rows, k_heads, k_dim, dtype=store, device=self.device),
                     torch.empty(rows, v_heads, v_dim, dtype=store, device=self.device))
            self.layers[idx] = pools
            if self.codes is not None:
                self.scales[idx] = (torch.ones(rows, k_heads, device=self.device),
                                    torch.ones(rows, v_heads, device=self.device))
        return pools

    def close(self) -> None:
        self.layers.clear()
        self.scales.clear()
        self.states.clear()


class PagedCache:
    """The ``cache`` object handed to the model: stores each layer's new rows in the pool. Deliberately not a
    transformers ``Cache``: a layer asking for anything but ``update`` (conv/SSM state) fails the probe."""

    is_compileable = False

    def __init__(self, pool: KVPool | None):
        self.pool = pool
        self.seen: dict[int, tuple] = {}  # probe: layer -> (k shape, v shape, dtype)
        self.stateful: dict[int, int] = {}  # probe: layer -> bytes of per-sequence state it keeps in the pool's seats

    def update(self, key_states, value_states, layer_idx, *args, step: StepContext | None = None, **kwargs):
        """Store the step's new rows [1, Hkv, N, D]; return every scheduled sequence's whole context in the
        step's key layout [1, Hkv, X, D]. The model may transform them further (MLA expands its latents). ``step``:
        the owned graph passes it (model/graph.py); transformers' modules find it on the thread (``active``)."""
        step = step if step is not None else _active.step
        if step.probe:
            self.seen[layer_idx] = (tuple(key_states.shape), tuple(value_states.shape), key_states.dtype)
            return key_states, value_states
        kp, vp = self.pool.layer(layer_idx, key_states, value_states)
        if self.pool.codes is not None:
            return self._update_quantized(kp, vp, key_states, value_states, layer_idx, step)
        kp.index_copy_(0, step.slot_mapping, key_states[0].transpose(0, 1))  # [N, Hkv, D]
        vp.index_copy_(0, step.slot_mapping, value_states[0].transpose(0, 1))
        if step.view is not None:
            first, n = step.view
            k, v = kp[first : first + n], vp[first : first + n]  # views
        else:
            k, v = kp.index_select(0, step.gather), vp.index_select(0, step.gather)  # [X, Hkv, D]
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def _update_quantized(self, kp, vp, key_states, value_states, layer_idx: int, step: StepContext):
        """``update`` over a quantized pool: the new rows' codes and scales in, the context dequantized out."""
        ks, vs = self.pool.scales[layer_idx]
        out = []
        for pool, scales, new in ((kp, ks, key_states), (vp, vs, value_states)):
            q, s = quantize(new[0].transpose(0, 1), pool.dtype)  # [N, H, D], [N, H]
            pool.index_copy_(0, step.slot_mapping, q)
            scales.index_copy_(0, step.slot_mapping, s)
            if step.view is not None:
                first, n = step.view
                rows = dequantize(pool[first : first + n], scales[first : first + n], new.dtype)
            else:
                rows = dequantize(pool.index_select(0, step.gather), scales.index_select(0, step.gather), new.dtype)
            out.append(rows.transpose(0, 1).unsqueeze(0))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly


def current() -> StepContext | None:
    """The step context of the forward running on this thread (None outside one)."""
    return getattr(_active, "step", None)


class active:
    """``with active(step): model(...)``: the step context the attention layers of this thread read."""

    def __init__(self, step: StepContext):
        self.step = step

    def __enter__(self):
        _active.step = self.step

    def __exit__(self, *exc):
        _active.step = None
        _active.latent = None


def paged_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function. query [1, Hq, N, D]; key/value [1, Hk, X, D] in the step's key layout."""
    step: StepContext = _active.step
    latent = getattr(_active, "latent", None)
    if latent is not None:  # an MLA layer whose expand_kv kept the latents: absorbed decode (mla.py)
        _active.latent = None
        return latent(query, key, value, scaling), None
    # the layer's window: passed by most families; Qwen2-MoE keeps it on the module only (its mask applies it)
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return attend(step, query, key, value, scaling, window, kwargs.get("s_aux"), kwargs.get("softcap")), None


def attend(step: StepContext, query, key, value, scaling, window=None, sinks=None, softcap=None) -> torch.Tensor:
    """The step's attention: query [1, Hq, N, D] over key/value [1, Hk, X, D] in the step's key layout (what
    ``PagedCache.update`` handed back) -> [1, N, Hq, Dv]. Decode rows of every sequence in one padded call, each
    prefill chunk its own (causal from its offset); ``window`` keys, ``sinks`` [Hq] (one extra logit per head)."""
    q = query[0]  # [Hq, N, D]
    if step.probe:
        out = _attend(query, key, value, None, scaling, sinks, softcap, causal=True)  # [1, Hq, N, Dv]
        return out.transpose(1, 2)
    out = query.new_empty(1, q.shape[1], q.shape[0], value.shape[-1])  # [1, N, Hq, Dv]
    if step.decode:
        Bd, L = len(step.decode), step.lmax
        qd = q.index_select(1, step.decode_rows).transpose(0, 1).unsqueeze(2)  # [Bd, Hq, 1, D]
        kd = key[0, :, : Bd * L].unflatten(1, (Bd, L)).transpose(0, 1)  # [Bd, Hk, L, D]
        vd = value[0, :, : Bd * L].unflatten(1, (Bd, L)).transpose(0, 1)
        mask = step.decode_mask
        if window:
            if mask is None and Bd == 1:  # one sequence, no padding: the window is a slice
                lo = max(0, L - window)
                kd, vd = kd[:, :, lo:], vd[:, :, lo:]
            else:
                ar = torch.arange(L, device=q.device)
                w = ar.unsqueeze(0) > (step.decode_pos.unsqueeze(1) - window)  # [Bd, L]
                mask = w[:, None, None, :] if mask is None else mask & w[:, None, None, :]
        o = _attend(qd, kd, vd, mask, scaling, sinks, softcap, causal=False)  # [Bd, Hq, 1, Dv]
        out[0].index_copy_(0, step.decode_rows, o[:, :, 0, :])
    tiled = _tiled(query, value, sinks, softcap)
    for s in step.seqs:
        if s.q_len == 1 and step.decode:
            continue
        if tiled and s.q_len > 1:  # the tiled bf16 kernel over the chunk's context (attention.cpp)
            ks = slice(s.k_start, s.k_start + s.ctx_len)
            out[0, s.q_start : s.q_start + s.q_len] = ops.prefill_attention(
                _rows(q[:, s.q_start : s.q_start + s.q_len]), _rows(key[0, :, ks]), _rows(value[0, :, ks]),
                scaling if scaling is not None else q.shape[-1] ** -0.5, window or 0)
            continue
        qs = q[:, s.q_start : s.q_start + s.q_len].unsqueeze(0)  # [1, Hq, q, D]
        k = key[:, :, s.k_start : s.k_start + s.ctx_len]  # [1, Hk, L, D]
        v = value[:, :, s.k_start : s.k_start + s.ctx_len]
        mask, causal = None, s.q_len == s.ctx_len and not window
        if not causal and (s.q_len > 1 or window):
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device).unsqueeze(1)  # [q, 1]
            kpos = torch.arange(s.ctx_len, device=q.device).unsqueeze(0)  # [1, L]
            mask = kpos <= qpos
            if window:
                mask = mask & (kpos > qpos - window)
            mask = mask[None, None]
        o = _attend(qs, k, v, mask, scaling, sinks, softcap, causal=causal)  # [1, Hq, q, Dv]
        out[0, s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
    return out


def _attend(q, k, v, mask, scaling, sinks, softcap, causal):
    """q [B, Hq, q, D], k/v [B, Hkv, L, D], mask bool [B|1, 1, q|1, L] or None -> [B, Hq, q, Dv]."""
    if sinks is None and softcap is None and q.shape[2] == 1 and q.dtype != torch.float32:
        return _decode_fp32(q, k, v, mask, scaling)
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    # eager: what the layer's own eager path computes (attention sinks: one extra logit per head, then dropped)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, Hq, q, L]
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if causal and mask is None:
        L, Q = w.shape[-1], w.shape[-2]
        mask = torch.ones(Q, L, dtype=torch.bool, device=w.device).tril(L - Q)[None, None]
    if mask is not None:
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    if sinks is not None:
        s = sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], 1).to(w.dtype)
        w = torch.cat([w, s], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
        p = torch.softmax(w, dim=-1, dtype=w.dtype)[..., :-1]
    else:
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p.to(v.dtype), v)


def _tiled(query, value, sinks, softcap) -> bool:
    """bf16 prefill chunks without sinks or softcap go to the tiled kernel where it is AVX512-BF16 (not a scalar build)."""
    if sinks is not None or softcap is not None or not query.is_cpu or {query.dtype, value.dtype} != {torch.bfloat16}:
        return False
    if query.shape[-1] % 2 or value.shape[-1] % 16 or not jit.load():
        return False
    return jit.info()["variant"] == "avx512bf16"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[heads, rows, D] -> [rows, heads, D] with each row's heads contiguous (a view where they are already)."""
    r = t.transpose(0, 1)
    return r if r.stride(2) == 1 and r.stride(1) == r.shape[2] else r.contiguous()


def _decode_fp32(q, k, v, mask, scaling):
    """One query row per sequence in a low-precision model: three small fp32 matmuls. torch's CPU flash-attention
    kernel spends ~130 us on one bf16 query over a few hundred keys (its set-up dominates), this ~30 us; the sums
    are fp32 either way. q [B, Hq, 1, D], k/v [B, Hkv, L, D], mask bool [B, 1, 1, L] or None -> [B, Hq, 1, Dv]."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).float()  # [B, Hkv, g, D]: the g query heads that share a KV head
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * (scaling if scaling is not None else D ** -0.5)  # [B, Hkv, g, L]
    if mask is not None:
        s = s.masked_fill(~mask.reshape(B, 1, 1, -1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype).reshape(B, Hq, 1, -1)  # [B, Hq, 1, Dv]


def register() -> None:
    """Register ``moe_offload_paged`` with transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)


def set_attention(model, name: str) -> str:
    """Set the attention implementation on the model's config and every sub-config; returns the old one."""
    old = model.config._attn_implementation
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            try:
                cfg._attn_implementation = name
            except (AttributeError, ValueError):
                pass
    return old
