"""4-bit safetensors releases (GPTQ, compressed-tensors pack-quantized, AWQ) loaded at 4 bits (loading/int4.py).

The checkpoints are written here from each format's definition (packing and dequantization formulas written out
below, independent of the loader): per-expert gate/up/down linears and one attention projection quantized in groups
(symmetrically, or with a zero point per group: AWQ, GPTQ sym=false, compressed-tensors symmetric=false), everything
else float. The reference is transformers running the model those weights mean (scale * (q - 8), with zero points:
scale * (q - zero)), in fp32: greedy tokens must be equal for every policy and fraction. Act-order releases (GPTQ
desc_act, compressed-tensors actorder group) quantize each linear's inputs in a random order and store g_idx.
Legend: R output rows, K input features, G group size.
"""

from __future__ import annotations

import json

import pytest
import torch
from offload_helpers import greedy, moe_layers, placement
from quant_helpers import assert_activation_rounding_bounded

from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.errors import ModelError

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]


def _pack8(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes (0..15) -> int32 words of 8 codes along ``dim``, code j of a word at bits 4j."""
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    words = sum(c[..., j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 bit pattern
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _unpack8(words: torch.Tensor, dim: int) -> torch.Tensor:
    """_pack8 undone: int32 words -> uint8 codes, 8x along ``dim``."""
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=-1).flatten(-2)
    return codes.to(torch.uint8).movedim(-1, dim).contiguous()


def _quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, K] -> (codes [R, K] in 0..15, fp16 scale [R, K/G]): symmetric, value (q - 8) * scale."""
    R, K = w.shape
    g = w.reshape(R, K // group, group)
    s = (g.abs().amax(-1) / 7).to(torch.float16)
    q = torch.round(g / s.float().unsqueeze(-1)).clamp(-8, 7) + 8
    return q.reshape(R, K).to(torch.uint8), s


def _quantize_zero(w: torch.Tensor, group: int, lowest: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, K] -> (codes [R, K], fp16 scale [R, K/G], zeros [R, K/G] in lowest..15, codes 0..15): value
    (q - zero) * scale."""
    R, K = w.shape
    g = w.reshape(R, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).to(torch.float16)
    z = torch.round(-lo / s.float()).clamp(lowest, 15)
    q = (torch.round(g / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(R, K).to(torch.uint8), s, z.to(torch.uint8)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i of word c holds column 8c + AWQ_ORDER[i]


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, R] -> int32 words [n, R/8] as AutoAWQ packs them."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    words = sum(c[..., AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _write(method: str, root, group: int = 64, scale_dtype=torch.float16, sym: bool = True, act_order: bool = False):
    """A release of a tiny qwen3_moe in ``method``'s layout; ``act_order``: GPTQ's desc_act (compressed-tensors'
    actorder group), every linear quantized in its own random input order p (gate and up of an expert in one, as
    they see the same inputs): input p[i] in group i // G, g_idx stored beside."""
    from gguf_helpers import config_for
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = config_for("qwen3_moe", 300)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    I = cfg.moe_intermediate_size
    tensors = {}
    orders = torch.Generator().manual_seed(1)

    def put(prefix: str, w: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        """Writes one linear in the format, its inputs quantized in the order p (act-order) or p drawn here; returns
        what the stored linear means."""
        if not act_order:
            return put_groups(prefix, w)
        K = w.shape[1]
        p = torch.randperm(K, generator=orders) if p is None else p
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[p] = (torch.arange(K) // group).to(torch.int32)  # input p[i] in group i // G
        meant = torch.empty_like(w)
        meant[:, p] = put_groups(prefix, w[:, p].contiguous())  # codes written for the permuted columns ...
        key = prefix + (".g_idx" if method == "gptq" else ".weight_g_idx")
        for k in [k for k in tensors if k.startswith(prefix + ".")]:  # ... then put back in input order
            if k.endswith((".qweight", ".weight_packed")):
                packed_k = 0 if method == "gptq" else 1  # GPTQ packs along K (rows of qweight), c-t along columns
                codes = _unpack8(tensors[k], packed_k)
                natural = torch.empty_like(codes)
                if packed_k == 0:
                    natural[p] = codes
                else:
                    natural[:, p] = codes
                tensors[k] = _pack8(natural, packed_k)
        tensors[key] = g_idx
        return meant

    def put_groups(prefix: str, w: torch.Tensor) -> torch.Tensor:  # writes one linear; returns what it means
        if method == "awq":
            q, s, z = _quantize_zero(w, group)
            tensors[prefix + ".qweight"] = _pack_awq(q.T)  # [K, R/8]
            tensors[prefix + ".qzeros"] = _pack_awq(z.T)  # [K/G, R/8]
            tensors[prefix + ".scales"] = s.T.contiguous()  # [K/G, R]
            return (q.float() - z.float().repeat_interleave(group, dim=1)) * s.float().repeat_interleave(group, dim=1)
        if method == "gptq" and not sym:  # zero points, stored as zero - 1 (the v1 format): zeros 1..15 here
            K, R = w.shape[1], w.shape[0]
            q, s, z = _quantize_zero(w, group, lowest=1)
            tensors[prefix + ".qweight"] = _pack8(q.T, 0)  # [K/8, R]
            tensors[prefix + ".scales"] = s.T.contiguous()  # [K/G, R]
            tensors[prefix + ".qzeros"] = _pack8((z - 1).T.contiguous(), 1)  # [K/G, R/8]
            tensors[prefix + ".g_idx"] = (torch.arange(K) // group).to(torch.int32)
            return (q.float() - z.float().repeat_interleave(group, dim=1)) * s.float().repeat_interleave(group, dim=1)
        if method == "compressed-tensors" and not sym:  # compressed-tensors 0.20.0 pack-quantized, symmetric=false
            q, s, z = _quantize_zero(w, group)
            qs, zs = q.int() - 8, z.int() - 8  # the format's int8 codes and zero points, both in -8..7
            tensors[prefix + ".weight_packed"] = _pack8((qs + 8).to(torch.uint8), 1)  # [R, K/8], stored + 8
            tensors[prefix + ".weight_zero_point"] = _pack8((zs + 8).to(torch.uint8), 0)  # [R/8, K/G]: along R
            tensors[prefix + ".weight_scale"] = s.to(scale_dtype)  # [R, K/G]
            tensors[prefix + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
            G = group
            return (qs - zs.repeat_interleave(G, dim=1)).float() * s.to(scale_dtype).float().repeat_interleave(G, dim=1)
        q, s = _quantize(w, group)
        if method == "gptq":
            K, R = w.shape[1], w.shape[0]
            tensors[prefix + ".qweight"] = _pack8(q.T, 0)  # [K/8, R]
            tensors[prefix + ".scales"] = s.T.contiguous()  # [K/G, R]
            tensors[prefix + ".qzeros"] = _pack8(torch.full((K // group, R), 7, dtype=torch.uint8), 1)  # zero - 1
            tensors[prefix + ".g_idx"] = (torch.arange(K) // group).to(torch.int32)
        else:
            tensors[prefix + ".weight_packed"] = _pack8(q, 1)  # [R, K/8]
            tensors[prefix + ".weight_scale"] = s.to(scale_dtype)
            tensors[prefix + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        return ((q.float() - 8) * s.to(scale_dtype).float().repeat_interleave(group, dim=1))

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                base = name.removesuffix(".gate_up_proj")
                for e in range(t.shape[0]):
                    p = torch.randperm(t.shape[2], generator=orders)  # one order for the inputs gate and up share
                    t[e, :I] = put(f"{base}.{e}.gate_proj", t[e, :I].clone(), p)
                    t[e, I:] = put(f"{base}.{e}.up_proj", t[e, I:].clone(), p)
            elif name.endswith("experts.down_proj"):
                base = name.removesuffix(".down_proj")
                for e in range(t.shape[0]):
                    t[e] = put(f"{base}.{e}.down_proj", t[e].clone())
            elif name == "model.layers.0.self_attn.q_proj.weight":  # a quantized non-expert linear: dequantized
                t.copy_(put(name.removesuffix(".weight"), t.clone()))
            else:
                tensors[name] = t.contiguous()
    path = root / f"{method}-{group}{'' if sym else '-zp'}{'-act' if act_order else ''}"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    c = cfg.to_dict()
    if method == "awq":
        c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                    "version": "gemm"}
    elif method == "gptq":
        c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                    "desc_act": act_order, "checkpoint_format": "gptq"}
    else:
        c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                                        "group_size": group, "actorder": "group" if act_order else None}}}}
    (path / "config.json").write_text(json.dumps(c))
    return str(path), model


@pytest.mark.parametrize("method,scale_dtype,sym,act_order", [
    ("gptq", torch.float16, True, False), ("compressed-tensors", torch.bfloat16, True, False),
    ("awq", torch.float16, False, False), ("gptq", torch.float16, False, False),
    ("compressed-tensors", torch.bfloat16, False, False),
    ("gptq", torch.float16, True, True), ("gptq", torch.float16, False, True),
    ("compressed-tensors", torch.bfloat16, True, True)])
def test_release_matches_the_model_it_means(tmp_path, method, scale_dtype, sym, act_order):
    path, ref = _write(method, tmp_path, 64, scale_dtype, sym, act_order)
    want = greedy(ref, PROMPT, 10)
    layers, num_experts = moe_layers(path)
    fmt, block = ("q4_0", 18) if sym else ("q4_z", 19)  # 4.5 / 4.75 bits per weight
    orders = 4 * (256 + 256) if act_order else 0  # act-order: gate|up's and down's int32 input orders
    for policy, fraction in (("static", 1.0), ("static", 0.0), ("lru", 0.25)):
        om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, dtype="float32")
        store = om.executor.layers[0].store
        assert store.format == fmt and store.expert_bytes == 3 * 256 * 256 // 32 * block + orders
        assert greedy(om.model, PROMPT, 10)[0] == want[0], (method, policy, fraction)
    # bf16 compute: the block kernels; tokens do not depend on the fraction
    a = greedy(load_model(path, None, dtype="bfloat16").model, PROMPT, 10)[0]
    b = greedy(load_model(path, placement(layers, num_experts, 0.25, "lru"), policy="lru", dtype="bfloat16").model,
               PROMPT, 10)[0]
    assert a == b


@pytest.mark.parametrize("method,sym", [("gptq", True), ("compressed-tensors", False)])
def test_act_order_release_in_bf16_through_the_block_kernels(tmp_path, method, sym):
    # bf16: the kernels gather x (and h) in each expert's input orders; against the same experts dequantized (their
    # columns put back in feature order) within the activation rounding: a wrong or missing order would be far out
    path, _ = _write(method, tmp_path, 64, torch.bfloat16 if method != "gptq" else torch.float16, sym, act_order=True)
    base = load_model(path, None, dtype="bfloat16", expert_dtype="bf16")
    assert base.executor.layers[0].store.format == "bfloat16"
    om = load_model(path, None, dtype="bfloat16")
    assert om.executor.layers[0].store.tensors[4] is not None  # the orders are kept beside the blocks
    assert_activation_rounding_bounded(base, om, PROMPT, 16, method)


def test_spec_prices_the_release_at_4_bits(tmp_path):
    from moe_offload.control.spec import ModelSpec

    path, _ = _write("gptq", tmp_path, 32)
    spec = ModelSpec.from_hf_config(path)
    assert spec.expert_format == "q4_0" and spec.expert_bytes == 3 * 256 * 256 // 32 * 18
    for method in ("awq", "gptq", "compressed-tensors"):
        path, _ = _write(method, tmp_path, 32, sym=False)
        spec = ModelSpec.from_hf_config(path)
        assert spec.expert_format == "q4_z" and spec.expert_bytes == 3 * 256 * 256 // 32 * 19


def test_unsupported_releases_fail_in_one_line(tmp_path):
    path, _ = _write("gptq", tmp_path, 64)
    cfg = json.loads((tmp_path / "gptq-64" / "config.json").read_text())
    for qc, msg in (({"checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
                    ({"group_size": 48}, "group size 48 is not supported"), ({"bits": 8}, "bits=8")):
        bad = dict(cfg, quantization_config=dict(cfg["quantization_config"], **qc))
        (tmp_path / "gptq-64" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelError, match=msg):
            load_model(path, None)
    for qc, msg in (({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ with bits=4 zero_point=True "
                                                                           "version='gemv' is not supported"),
                    ({"quant_method": "hqq", "bits": 4}, "quant_method 'hqq' is not supported")):
        (tmp_path / "gptq-64" / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
        with pytest.raises(ModelError, match=msg):
            load_model(path, None)


class _Files(dict):
    """A checkpoint's tensors by key, as int4.read asks for them."""

    def tensor(self, key: str) -> torch.Tensor:
        return self[key]


def test_asymmetric_compressed_tensors_per_channel_with_rows_not_a_multiple_of_8():
    # channel strategy: one scale and zero point per row; 12 rows pack into 2 words of zero points along R, the
    # last 4 nibbles padding (pack_to_int32 pads with 0 before its + 8, so they read back as 8)
    from moe_offload.engines.offload.loading import int4

    torch.manual_seed(0)
    R, K = 12, 64
    qs = torch.randint(-8, 8, (R, K), dtype=torch.int32)  # the format's int8 codes
    zs = torch.randint(-8, 8, (R, 1), dtype=torch.int32)
    s = torch.rand(R, 1, dtype=torch.float16) + 0.5
    pad = torch.cat([zs + 8, torch.full((4, 1), 8, dtype=torch.int32)])  # [16, 1]
    files = _Files({"l.weight_packed": _pack8((qs + 8).to(torch.uint8), 1), "l.weight_scale": s,
                    "l.weight_zero_point": _pack8(pad.to(torch.uint8), 0), "l.weight_shape": torch.tensor([R, K])})
    q, scale, z, p = int4.read(files, "l", "compressed-tensors_zp")
    want = (qs - zs).float() * s.float()  # compressed-tensors' _dequantize: (x_q - zero_point) * scale
    assert p is None
    torch.testing.assert_close(int4.dequantize(q, scale, z, p, torch.float32), want, rtol=0, atol=0)
    # the q4_z blocks hold the same weights: fp16 d, the zero point byte, then q4_0's nibbles
    blocks = int4.to_blocks(q, scale, z, "l").view(torch.uint8)  # [R, K/32, 19]
    assert torch.equal(blocks[..., 2], (zs + 8).to(torch.uint8).expand(R, K // 32))
    files["l.weight_zero_point"] = (zs + 8).to(torch.int8)  # not packed: refused, the tensor named
    with pytest.raises(ModelError, match=r"l.weight_zero_point: torch.int8 \[12, 1\]; expected int32 \[2, 1\]"):
        int4.read(files, "l", "compressed-tensors_zp")


@pytest.mark.parametrize("act_order", [False, True])
def test_disk_tier_serves_the_release_at_4_bits(tmp_path, monkeypatch, act_order):
    # experts on disk (the expert store file written from the release, act-order orders with them), host memory
    # caching a few: same tokens
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    path, ref = _write("gptq", tmp_path, 64, act_order=act_order)
    om = load_model(path, None, dtype="float32", host_cache=3 * 2**20)
    assert om.executor.layers[0].store.format == "q4_0" and om.executor.disk is not None
    assert greedy(om.model, PROMPT, 8)[0] == greedy(ref, PROMPT, 8)[0]
