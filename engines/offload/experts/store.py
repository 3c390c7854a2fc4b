"""The host store: every routed expert of every MoE layer, once, in host DRAM.

Per layer it keeps the module's fused tensors as loaded (``[E, ...]``), so the
store costs no copy on a CPU run; with a CUDA accelerator they are moved into
pinned memory (page-locked) so fetches can be asynchronous DMA.

An expert is kept as it is stored (quant.py): float tensors, or quantized weights
with their scales (int8, fp8, mxfp4), so a fetch copies exactly the stored bytes.
``convert`` turns a float layer into int8/fp8 (``--expert-dtype``) one expert at
a time, so the extra memory at load is one expert in fp32.

Legend: E experts, H hidden, I intermediate, RB/CB fp8 block rows/columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_offload.engines.offload.loading import hugepages, quant

# Names of an experts module's routed tensors, in the order the kernel takes them.
WEIGHT_NAMES = ("up", "down", "up_bias", "down_bias", "up_scale", "down_scale")


@dataclass
class LayerStore:
    """One layer's experts on the host. ``tensors`` = (up, down, up_bias [E,2I] | None, down_bias [E,H] | None,
    up_scale | None, down_scale | None): float up [E,2I,H] ([E,H,2I] transposed), down [E,H,I]; or quantized up
    [E,2I,H] / [E,2I,H/2] (mxfp4), down [E,H,I] / [E,H,I/2] with their scales (quant.py).
    ``compute_dtype``: the dtype expert outputs come in (the model's; float stores: their own dtype)."""

    tensors: tuple[torch.Tensor | None, ...]
    compute_dtype: torch.dtype | None = None

    def __post_init__(self):
        self.tensors = tuple(self.tensors) + (None,) * (len(WEIGHT_NAMES) - len(self.tensors))
        if self.compute_dtype is None:
            self.compute_dtype = self.tensors[0].dtype

    @property
    def num_experts(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def format(self) -> str:
        """"int8" | "fp8" | "mxfp4" | the float dtype name ("bfloat16", ...)."""
        return quant.format_of(self.tensors[0]) or str(self.tensors[0].dtype).removeprefix("torch.")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (all its tensors, as stored)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors if t is not None)

    @property
    def expert_params(self) -> int:
        """Weights of one expert (an mxfp4 byte holds two; scales are not weights), biases included."""
        up, down, ub, db = self.tensors[:4]
        if quant.ggml.is_blocks(up):
            n = up.shape[1] * quant.ggml.features(up) + down.shape[1] * quant.ggml.features(down)
        else:
            n = (up[0].numel() + down[0].numel()) * (2 if self.format == "mxfp4" else 1)
        return n + sum(b[0].numel() for b in (ub, db) if b is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole layer (all experts)."""
        return self.expert_bytes * self.num_experts

    def expert(self, e: int) -> tuple[torch.Tensor | None, ...]:
        """Views of expert ``e``'s tensors (no copy)."""
        return tuple(t[e] if t is not None else None for t in self.tensors)

    def views(self, e: int) -> tuple[torch.Tensor | None, ...]:
        """Where expert ``e``'s tensors live, without reading them in (a disk-backed store's slot may still be
        filling: see hostcache.CachedLayerStore.settle)."""
        return self.expert(e)


def convert(store: LayerStore, fmt: str, *, transposed: bool, split: int) -> LayerStore:
    """A float layer in ``fmt``: "int8" | "fp8" | "mxfp4" (quantized per expert; ``transposed``: the float layout is
    [E, K, R], as gpt-oss) or a float dtype name (cast). Biases keep their dtype; compute dtype is unchanged."""
    up, down, ub, db = store.tensors[:4]
    if fmt not in quant.QUANTIZED:
        dt = getattr(torch, fmt)
        return LayerStore((up.to(dt), down.to(dt), ub, db), store.compute_dtype)
    out = []
    for w, s in ((up, split), (down, 0)):
        rows = (w.transpose(1, 2) if transposed else w)  # [E, R, K]
        q = scales = None
        for e in range(rows.shape[0]):  # one expert at a time: the fp32 copies stay small
            qe, se = quant.quantize(rows[e], fmt, s)
            if q is None:
                q = torch.empty((rows.shape[0], *qe.shape), dtype=qe.dtype)
                scales = None if se is None else torch.empty((rows.shape[0], *se.shape), dtype=se.dtype)
            q[e] = qe
            if scales is not None:
                scales[e] = se
        out.append((q, scales))
    (qu, su), (qd, sd) = out
    return LayerStore((qu, qd, ub, db, su, sd), store.compute_dtype)


def finalize(store: LayerStore, module: torch.nn.Module, pin: bool, was_float: bool, convert_to: str | None
             ) -> tuple[LayerStore, bool]:
    """(the store as the engine keeps it, whether its float weights were turned into [out, in] rows, after which the
    module reads as untransposed): ``convert_to`` applied (see ``convert``), else bf16 experts in transformers' [in,
    out] layout (gpt-oss) kept as rows on a CPU engine (``not pin``), the layout the bf16 kernels stream (torch's
    one-row GEMM on [in, out] reads ~20 GB/s; those experts are only ever computed from the store). The module is
    not changed: the expert store file's writer finalizes one expert at a time with it."""
    if convert_to is not None and convert_to != store.format:
        from moe_offload.engines.offload.kernels.dispatch import gate_up_split

        rows = store.tensors[0].shape[2 if module.is_transposed else 1]
        return convert(store, convert_to, transposed=module.is_transposed, split=gate_up_split(module, rows)), False
    if (was_float and not pin and module.is_transposed and store.tensors[0].dtype == torch.bfloat16
            and store.tensors[1] is not None):
        up, down = (t.transpose(1, 2).contiguous() for t in store.tensors[:2])
        return LayerStore((up, down, *store.tensors[2:]), store.compute_dtype), True
    return store, False


def finalize_expert(module: torch.nn.Module, dtype: torch.dtype, up, down, up_scale=None, down_scale=None,
                    was_float: bool = True, convert_to: str | None = None) -> tuple[tuple, bool]:
    """One expert's record (up, down, up_scale, down_scale) as ``finalize`` makes a layer of it (the expert store
    file's writer), and whether its float weights were made [out, in] rows."""
    one = LayerStore(tuple(None if t is None else t[None] for t in (up, down, None, None, up_scale, down_scale)), dtype)
    one, rows = finalize(one, module, False, was_float, convert_to)
    return tuple(None if t is None else t[0] for t in (*one.tensors[:2], *one.tensors[4:6])), rows


def cold_copy(store: LayerStore, module: torch.nn.Module, fmt: str) -> LayerStore:
    """The layer's experts in ``fmt`` ("int8"), computed from when they miss (an APPROXIMATE mode: cold experts in lower
    precision, resident ones as stored). A second copy of the layer in host memory, quantized one expert at a time."""
    from moe_offload.engines.offload.kernels.dispatch import gate_up_split

    if quant.format_of(store.tensors[0]) is not None:
        raise ValueError(f"experts already stored as {store.format}")
    rows = store.tensors[0].shape[2 if module.is_transposed else 1]
    return convert(store, fmt, transposed=module.is_transposed, split=gate_up_split(module, rows))


def module_tensor_names(module: torch.nn.Module) -> tuple[str | None, ...]:
    """Attribute names of (up, down, up_bias, down_bias) on a transformers experts module."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    bias = getattr(module, "has_bias", False)
    return (up, "down_proj", up + "_bias" if bias else None, "down_proj_bias" if bias else None)


def take_from_module(module: torch.nn.Module, pin: bool, stored: tuple | None = None, convert_to: str | None = None) -> LayerStore:
    """Move the module's routed expert tensors into a LayerStore and detach them from the module.

    The module keeps plain (non-Parameter) attributes pointing at the store, so
    ``model.to(device)`` never moves experts to the accelerator, while code that
    reads ``module.gate_up_proj`` still sees the host tensors.
    ``stored``: (up, down, up_scale, down_scale) read from a quantized checkpoint; the module's own weight
    parameters are then placeholders and are dropped (its biases are kept). ``convert_to``: see ``convert``.
    """
    tensors = []
    for name in module_tensor_names(module):
        tensors.append(None if name is None else module._parameters.pop(name).detach())
    compute = tensors[0].dtype  # the model's dtype (placeholders are made in it too)
    if stored is not None:
        up, down, us, ds = stored
        store = LayerStore((up, down, tensors[2], tensors[3], us, ds), compute)
    else:
        store = LayerStore(tuple(tensors), compute)
    del tensors
    was_float = stored is None  # a dequantized checkpoint keeps its layout (direct.py never reads transposed experts)
    store, rows = finalize(store, module, pin, was_float, convert_to)
    if rows:
        module.is_transposed = False
    # one layer at a time: peak extra host memory is one layer's experts. Pinned for CUDA's DMA; else in huge pages
    # for the CPU kernels (no copy where the loader read them into huge-page memory already)
    move = (lambda t: t.pin_memory()) if pin else hugepages.rehome
    store = LayerStore(tuple(move(t) if t is not None else None for t in store.tensors), store.compute_dtype)
    for name, t in zip(module_tensor_names(module), store.tensors):
        if name is not None:
            object.__setattr__(module, name, t)
    return store
