"""Weight binding for the fused decode paths: a model's linears as the kernels read them, once at build.

    fuse_rows(*linears) / fuse_quantized_rows(*linears) -> one [sum of out, in] tensor (bf16, or int8 rows + scales,
        or ggml blocks) whose row blocks the modules' weights become views of: one GEMV reads what several did
    fuse_linears(*linears) -> (rows, scales | None), whichever of the two takes them
    weight_and_scale(linear) -> (weight, scale | None) as a kernel takes one linear
    silu_mlp(mlp) / mlp_args(mlp) -> a silu MLP's (gate|up rows, down, scales) for moe_blocks.mlp_rows
    decoder(model) -> the text decoder whose layers every path binds (a vision-language wrapper's language model)

Surgery, not compute: a row's dot product does not depend on its neighbours, so outputs are bit-identical after a
fusion. Compute lives in moe_blocks.py, fastpath.py, mla_plan.py and the kernels.
"""

from __future__ import annotations

import torch

from moe_offload.engines.offload.loading.quant import RowsLinear


def decoder(model):
    """The text decoder (embed_tokens, rotary_emb, layers, norm) of a causal LM: ``model.model``, or, where that is
    a vision-language wrapper (Qwen3-VL, Qwen3.5, GLM-4.5V), its ``language_model``: the text path the engine
    serves. The LM head stays ``model.lm_head``. None where the model has neither."""
    inner = getattr(model, "model", None)
    text = getattr(inner, "language_model", None)
    return text if isinstance(text, torch.nn.Module) else inner


FFN_NAMES = ("mlp", "block_sparse_moe")  # a decoder layer's feed-forward part under its names (Granite: block_sparse_moe)


def ffn_of(layer):
    """A decoder layer's feed-forward part (its MLP or MoE block), or None."""
    return next((m for m in (getattr(layer, n, None) for n in FFN_NAMES) if m is not None), None)


def shared_expert_of(layer, block):
    """The shared expert of a MoE ``block`` (``shared_expert`` / ``shared_experts``), or the shared MLP beside it in
    ``layer`` (GraniteMoeShared's ``shared_mlp``, the same input); None."""
    return next((m for m in (getattr(block, "shared_expert", None), getattr(block, "shared_experts", None),
                             getattr(layer, "shared_mlp", None)) if m is not None), None)


def fuse_rows(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """One [sum of out, in] weight whose row blocks become the linears' weights (views: no second copy), so that
    one GEMV reads what several did; each row's sum is the same dot product as before (bit-identical outputs).
    None (and nothing changed) unless they are bias-free bf16 CPU nn.Linears over the same input width. Built
    once the model is where it stays (a later ``model.to()`` would move the linears' weights, not the fused
    tensor the caller keeps)."""
    ws = [getattr(m, "weight", None) for m in linears]
    if any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears) or any(
            w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] != ws[0].shape[1] for w in ws):
        return None
    fused = torch.cat([w.detach() for w in ws])
    row = 0
    for m, w in zip(linears, ws):
        m.weight = torch.nn.Parameter(fused[row : row + w.shape[0]], requires_grad=False)
        row += w.shape[0]
    return fused


def fuse_quantized_rows(*linears) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fuse_rows for int8 QuantLinears (rows and their per-row scales) or BlockLinears of one ggml block type (scales
    empty: the blocks carry theirs): (rows, scales), the modules' buffers views of them. A row's dot product does not
    depend on its neighbours, so outputs are unchanged. None (nothing changed) unless bias-free CPU linears of one
    class, one format and one input width."""
    if not linears or any(not isinstance(m, RowsLinear) or m.bias is not None or type(m) is not type(linears[0]) for m in linears):
        return None
    ws = [m.weight_q for m in linears]
    if any(w.dtype != ws[0].dtype or w.shape[1:] != ws[0].shape[1:] or w.device.type != "cpu" for w in ws):
        return None
    rows = torch.cat(ws)
    per_row = linears[0].weight_scale.numel() > 0  # int8: a scale per row; blocks: none
    scales = torch.cat([m.weight_scale for m in linears]) if per_row else linears[0].weight_scale
    r = 0
    for m, w in zip(linears, ws):
        m.weight_q = rows[r : r + w.shape[0]]
        if per_row:
            m.weight_scale = scales[r : r + w.shape[0]]
        r += w.shape[0]
    return rows, scales


def is_silu(act) -> bool:
    """``act`` is a SiLU module (torch's, or transformers' activation of that name)."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def silu_mlp(mlp) -> bool:
    """silu(gate(x)) * up(x) -> down, three nn.Linears (down bias-free bf16: what moe_experts_bf16 computes) or three
    bias-free quantized rows linears (what moe_experts_q computes)."""
    if not is_silu(getattr(mlp, "act_fn", None)):
        return False
    ms = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if all(type(m) is torch.nn.Linear for m in ms):
        return ms[2].bias is None and ms[2].weight.dtype == torch.bfloat16
    return all(isinstance(m, RowsLinear) and m.bias is None for m in ms)


def fuse_linears(*linears) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rows, scales) that one kernel call reads for ``linears`` over the same input: bf16 nn.Linears fused by
    fuse_rows (scales None), or quantized rows by fuse_quantized_rows; None where neither takes them."""
    if type(linears[0]) is torch.nn.Linear:
        rows = fuse_rows(*linears)
        return None if rows is None else (rows, None)
    return fuse_quantized_rows(*linears)


def weight_and_scale(m) -> tuple:
    """(weight, scale) as the kernels take a linear: a quantized one's rows and scales (gemv_q), else (weight, None)."""
    return (m.weight_q, m.weight_scale) if isinstance(m, RowsLinear) else (m.weight, None)


def shared_mlp_args(m) -> tuple | None:
    """mlp_args of a shared expert beside the routed ones: gate/up/down linears, or Granite's input_linear (gate|up
    rows, chunked in that order) and output_linear around a silu; else None."""
    if not hasattr(m, "input_linear"):
        return mlp_args(m)
    lin, out = m.input_linear, m.output_linear
    if not is_silu(getattr(m, "activation", None)) or lin.bias is not None or out.bias is not None:
        return None
    if type(lin) is torch.nn.Linear and type(out) is torch.nn.Linear:
        ok = lin.weight.dtype == out.weight.dtype == torch.bfloat16 and lin.weight.device.type == "cpu"
        return (lin.weight, out.weight, None, None) if ok else None
    if isinstance(lin, RowsLinear) and isinstance(out, RowsLinear):
        (w, s), (d, ds) = weight_and_scale(lin), weight_and_scale(out)
        return w, d, s, ds
    return None


def mlp_args(mlp) -> tuple | None:
    """(gate|up rows fused, down, gate|up scales, down scales) of a silu MLP that mlp_rows computes: bias-free bf16
    nn.Linears (scales None), or --dense-dtype int8 / GGUF rows (gate and up of one format); else None."""
    if not silu_mlp(mlp):
        return None
    fused = fuse_linears(mlp.gate_proj, mlp.up_proj)
    if fused is None:
        return None
    down, down_scale = weight_and_scale(mlp.down_proj)
    return fused[0], down, fused[1], down_scale
