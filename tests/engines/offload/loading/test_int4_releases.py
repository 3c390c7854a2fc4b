"""4-bit safetensors releases (GPTQ, compressed-tensors pack-quantized, AWQ) loaded at 4 bits (loading/int4.py).

The checkpoints are written here from each format's definition (packing and dequantization formulas written out
below, independent of the loader): per-expert gate/up/down linears and one attention projection quantized in groups
(symmetrically, or with a zero point per group: AWQ, GPTQ sym=false, compressed-tensors symmetric=false), everything
else float. The reference is transformers running the model those weights mean (scale * (q - 8), with zero points:
scale * (q - zero)), in fp32: greedy tokens must be equal for every policy and fraction.
Legend: R output rows, K input features, G group size.
"""

from __future__ import annotations

import json

import pytest
import torch
from offload_helpers import greedy, moe_layers, placement

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


def _write(method: str, root, group: int = 64, scale_dtype=torch.float16, sym: bool = True):
    from gguf_helpers import config_for
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = config_for("qwen3_moe", 300)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    I = cfg.moe_intermediate_size
    tensors = {}

    def put(prefix: str, w: torch.Tensor) -> torch.Tensor:  # writes one linear in the format; returns what it means
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
                    t[e, :I] = put(f"{base}.{e}.gate_proj", t[e, :I].clone())
                    t[e, I:] = put(f"{base}.{e}.up_proj", t[e, I:].clone())
            elif name.endswith("experts.down_proj"):
                base = name.removesuffix(".down_proj")
                for e in range(t.shape[0]):
                    t[e] = put(f"{base}.{e}.down_proj", t[e].clone())
            elif name == "model.layers.0.self_attn.q_proj.weight":  # a quantized non-expert linear: dequantized
                t.copy_(put(name.removesuffix(".weight"), t.clone()))
            else:
                tensors[name] = t.contiguous()
    path = root / f"{method}-{group}{'' if sym else '-zp'}"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    c = cfg.to_dict()
    if method == "awq":
        c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                    "version": "gemm"}
    elif method == "gptq":
        c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                    "desc_act": False, "checkpoint_format": "gptq"}
    else:
        c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                                        "group_size": group}}}}
    (path / "config.json").write_text(json.dumps(c))
    return str(path), model


@pytest.mark.parametrize("method,scale_dtype,sym", [("gptq", torch.float16, True), ("compressed-tensors", torch.bfloat16, True),
                                                    ("awq", torch.float16, False), ("gptq", torch.float16, False),
                                                    ("compressed-tensors", torch.bfloat16, False)])
def test_release_matches_the_model_it_means(tmp_path, method, scale_dtype, sym):
    path, ref = _write(method, tmp_path, 64, scale_dtype, sym)
    want = greedy(ref, PROMPT, 10)
    layers, num_experts = moe_layers(path)
    fmt, block = ("q4_0", 18) if sym else ("q4_z", 19)  # 4.5 / 4.75 bits per weight
    for policy, fraction in (("static", 1.0), ("static", 0.0), ("lru", 0.25)):
        om = load_model(path, placement(layers, num_experts, fraction, policy), policy=policy, dtype="float32")
        store = om.executor.layers[0].store
        assert store.format == fmt and store.expert_bytes == 3 * 256 * 256 // 32 * block
        assert greedy(om.model, PROMPT, 10)[0] == want[0], (method, policy, fraction)
    # bf16 compute: the block kernels; tokens do not depend on the fraction
    a = greedy(load_model(path, None, dtype="bfloat16").model, PROMPT, 10)[0]
    b = greedy(load_model(path, placement(layers, num_experts, 0.25, "lru"), policy="lru", dtype="bfloat16").model,
               PROMPT, 10)[0]
    assert a == b


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
    for qc, msg in (({"desc_act": True}, "desc_act=True"),
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
    q, scale, z = int4.read(files, "l", "compressed-tensors_zp")
    want = (qs - zs).float() * s.float()  # compressed-tensors' _dequantize: (x_q - zero_point) * scale
    torch.testing.assert_close(int4.dequantize(q, scale, z, torch.float32), want, rtol=0, atol=0)
    # the q4_z blocks hold the same weights: fp16 d, the zero point byte, then q4_0's nibbles
    blocks = int4.to_blocks(q, scale, z, "l").view(torch.uint8)  # [R, K/32, 19]
    assert torch.equal(blocks[..., 2], (zs + 8).to(torch.uint8).expand(R, K // 32))
    files["l.weight_zero_point"] = (zs + 8).to(torch.int8)  # not packed: refused, the tensor named
    with pytest.raises(ModelError, match=r"l.weight_zero_point: torch.int8 \[12, 1\]; expected int32 \[2, 1\]"):
        int4.read(files, "l", "compressed-tensors_zp")


def test_disk_tier_serves_the_release_at_4_bits(tmp_path, monkeypatch):
    # experts on disk (the expert store file written from the release), host memory caching a few: same tokens
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    path, ref = _write("gptq", tmp_path, 64)
    om = load_model(path, None, dtype="float32", host_cache=3 * 2**20)
    assert om.executor.layers[0].store.format == "q4_0" and om.executor.disk is not None
    assert greedy(om.model, PROMPT, 8)[0] == greedy(ref, PROMPT, 8)[0]
