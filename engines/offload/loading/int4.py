"""4-bit safetensors releases (W4A16): GPTQ, compressed-tensors ``pack-quantized`` and AWQ, kept at 4 bits.

    GPTQ (quant_method "gptq", checkpoint_format "gptq"):  <linear>.qweight int32 [K/8, R] (8 codes per word along K,
        code k at bits 4*(k%8)), .scales fp16 [K/G, R], .qzeros int32 [K/G, R/8] (zero - 1 along R), .g_idx [K]
        w[r, k] = scales[g, r] * (q[k, r] - (zeros[g, r] + 1)),  g = k / G
    compressed-tensors pack-quantized: <linear>.weight_packed int32 [R, K/8] (code k at bits 4*(k%8)),
        .weight_scale [R, K/G], .weight_shape [2]; symmetric: w[r, k] = weight_scale[r, g] * (q[r, k] - 8)
    GPTQ sym=false ("gptq_zp" here): the same tensors, zeros[g, r] + 1 any of 1..16, the same formula
    compressed-tensors symmetric=false ("compressed-tensors_zp" here): the same tensors and .weight_zero_point int32
        [ceil(R/8), K/G] (8 zero points per word along R, zero point r at bits 4*(r%8)); codes and zero points are
        stored as the signed value + 8, so w[r, k] = weight_scale[r, g] * (q[r, k] - zp[r, g]), both 0..15
    AWQ (quant_method "awq", version "gemm", zero_point): <linear>.qweight int32 [K, R/8] (8 codes per word along R in
        AutoAWQ's order: nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), .qzeros int32 [K/G, R/8] (same
        order), .scales fp16 [K/G, R]; w[r, k] = scales[g, r] * (q[k, r] - zeros[g, r])

Both symmetric layouts (zero point 8, groups of a multiple of 32 along K) are exactly llama.cpp's q4_0 blocks: an
fp16 scale and 32 codes, value (q - 8) * d. They are repacked to q4_0 at load (the same bits, another order; the
scales are checked to survive fp16), so the store, the slots and the kernels are the GGUF path's (ggml.py) and a
release costs its 4.5 bits per weight. A zero point per group (AWQ, GPTQ sym=false) makes them this engine's q4_z
blocks instead: q4_0 with a zero point byte, d * (q - z), 4.75 bits per weight, the weights exact in fp32 as the
release defines them. The same goes for asymmetric compressed-tensors (compressed-tensors 0.20.0,
compressors/pack_quantized: pack_to_int32 adds 8 to the signed int4 codes and zero points alike, the zero point packed
along R; quantization/lifecycle/forward_helpers.py _dequantize: (q - zp) * scale).

Act-order (GPTQ desc_act, compressed-tensors actorder "group"): g_idx [K] names input k's group, and the groups are
not runs of G consecutive inputs: GPTQ quantized the inputs in a permuted order p, input p[i] in group i // G. The
inputs are kept in that order (codes[:, p], so every block of 32 has one scale again) with p beside them (int32
[K], the store's scale slot of a ggml weight): the kernels read x[p] (kernels/csrc/cpu/moe_quant.cpp), the float paths
put column j back at p[j] (quant.unpermute). Costs 4 bytes per input feature per projection.
Legend: R output rows, K input features, G group size, p the act-order permutation.
"""

from __future__ import annotations

import torch

from moe_offload.control.quant_config import INT4_METHODS
from moe_offload.engines.offload.loading import ggml, quant
from moe_offload.errors import ModelError

# gptq_zp: a GPTQ release with sym=false, as checkpoint.quant_method names it (the config says "gptq")
METHODS = (*INT4_METHODS, "gptq_zp")
# each method's packed weight key (standing for "<linear>.weight") and the keys beside it
WEIGHT = {"gptq": ".qweight", "compressed-tensors": ".weight_packed", "awq": ".qweight"}
BESIDE = {"gptq": (".scales", ".qzeros", ".g_idx"),
          "compressed-tensors": (".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx"),
          "awq": (".scales", ".qzeros")}
WEIGHT["gptq_zp"], BESIDE["gptq_zp"] = WEIGHT["gptq"], BESIDE["gptq"]  # the same tensors
# compressed-tensors_zp: an asymmetric compressed-tensors release (the config says "compressed-tensors")
METHODS = (*METHODS, "compressed-tensors_zp")
WEIGHT["compressed-tensors_zp"] = WEIGHT["compressed-tensors"]
BESIDE["compressed-tensors_zp"] = BESIDE["compressed-tensors"]
AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of a word's 8 is nibble AWQ_UNDO[j] (inverse of AutoAWQ's order)


def _unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles each (nibble j at bits 4j) -> uint8 codes, 8x along ``dim``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=dim + 1)  # [.., n, 8, ..]
    return codes.flatten(dim, dim + 1).to(torch.uint8)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 words [n, R/8] -> codes [n, R] in column order."""
    u = _unpack(words, 1)
    return u.view(u.shape[0], -1, 8)[..., AWQ_UNDO].reshape(u.shape[0], -1)


def read(files, prefix: str, method: str
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(codes uint8 [R, K], scale fp32 [R, K/G], zeros uint8 [R, K/G] or None, p int32 [K] or None) of the linear
    ``prefix``: the weight is (q - z) * scale, z = 8 where zeros is None (the symmetric layouts); with act-order, p is
    the order its inputs are kept in (codes column j is input p[j]; groups consecutive again), else None."""
    where = f"{prefix}{WEIGHT[method]}"
    if method == "awq":
        q = _unpack_awq(files.tensor(prefix + ".qweight")).T.contiguous()  # [R, K]
        z = _unpack_awq(files.tensor(prefix + ".qzeros")).T.contiguous()  # [R, K/G]
        s = files.tensor(prefix + ".scales").float().T.contiguous()  # [R, K/G]
        if z.shape != s.shape or q.shape[0] != s.shape[0]:
            raise ModelError(f"{where}: qweight, qzeros and scales do not agree ({list(q.shape)}, {list(z.shape)}, "
                             f"{list(s.shape)} as [R, K], [R, K/G], [R, K/G])")
        return q, s, z, None
    if method in ("gptq", "gptq_zp"):
        q = _unpack(files.tensor(prefix + ".qweight"), 0).T  # [R, K]
        s = files.tensor(prefix + ".scales").float().T  # [R, K/G]
        z = _unpack(files.tensor(prefix + ".qzeros"), 1).T[: q.shape[0]].int() + 1  # [R, K/G], the +1 of v1
        p = _order(files.tensor(prefix + ".g_idx"), q.shape[1], s.shape[1], prefix + ".g_idx") \
            if prefix + ".g_idx" in files else None
        q = q if p is None else q[:, p.long()].contiguous()
        if method == "gptq_zp":
            return q, s, z.to(torch.uint8), p  # 1..16: v1 stores zero - 1
        if not bool((z == 8).all()):
            raise ModelError(f"{where}: zero points other than 8 in a release whose config says sym=true")
        return q, s, None, p
    q = _unpack(files.tensor(prefix + ".weight_packed"), 1)  # [R, K]
    s = files.tensor(prefix + ".weight_scale").float()
    if s.dim() == 1 or s.shape[-1] == 1:
        s = s.reshape(-1, 1)
    if prefix + ".weight_shape" in files:
        R, K = (int(v) for v in files.tensor(prefix + ".weight_shape").tolist())
        q = q[:R, :K]
    p = None
    if prefix + ".weight_g_idx" in files:
        p = _order(files.tensor(prefix + ".weight_g_idx"), q.shape[1], s.shape[1], prefix + ".weight_g_idx")
        q = q if p is None else q[:, p.long()].contiguous()
    if method == "compressed-tensors_zp":
        return q, s, _ct_zeros(files, prefix + ".weight_zero_point", q.shape[0], s.shape[1]), p
    return q, s, None, p


def _ct_zeros(files, key: str, R: int, groups: int) -> torch.Tensor:
    """compressed-tensors' packed zero points int32 [ceil(R/8), K/G] -> uint8 [R, K/G] in 0..15 (signed + 8)."""
    if key not in files:
        raise ModelError(f"{key}: missing; an asymmetric (symmetric=false) compressed-tensors release keeps one")
    zp = files.tensor(key)
    want = [(R + 7) // 8, groups]
    if zp.dtype != torch.int32 or list(zp.shape) != want:
        # an unpacked or otherwise laid out zero point would need its own offset and range checks: refused
        raise ModelError(f"{key}: {zp.dtype} {list(zp.shape)}; expected int32 {want} (4-bit zero points packed "
                         "8 per word along the output rows)")
    return _unpack(zp, 0)[:R].contiguous()  # [R, K/G]


def _order(g_idx: torch.Tensor, K: int, groups: int, key: str) -> torch.Tensor | None:
    """The act-order permutation p (int32 [K]) that makes the groups of g_idx runs of K / groups consecutive inputs
    (g_idx[p] == j // G); None when they already are (no act-order). ModelError if no order does."""
    want = torch.arange(K) // (K // groups)
    g = g_idx.long().flatten()
    if g.numel() != K:
        raise ModelError(f"{key}: {g.numel()} entries for {K} inputs")
    if torch.equal(g, want):
        return None
    p = torch.argsort(g, stable=True)
    if not torch.equal(g[p], want):
        raise ModelError(f"{key}: groups of other than {K // groups} inputs each; not a GPTQ act-order index")
    return p.to(torch.int32)


def to_blocks(codes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, where: str) -> torch.Tensor:
    """read()'s weight as blocks of 32 holding the same weights: q4_0 [R, K/32, 18] (zeros None), else q4_z [R, K/32,
    19] (the fp16 scale, the zero point byte, q4_0's nibbles)."""
    q4 = to_q4_0(codes, scale, where)
    if zeros is None:
        return q4
    R, K = codes.shape
    if int(zeros.max()) > 16:  # 4-bit codes; GPTQ v1's stored zero - 1 can read back as 16
        raise ModelError(f"{where}: zero points above 16 in a 4-bit release")
    z = zeros.repeat_interleave((K // scale.shape[1]) // 32, dim=1)  # [R, K/32]
    raw = q4.view(torch.uint8)
    out = torch.empty(R, K // 32, 19, dtype=torch.uint8)
    out[..., :2], out[..., 2], out[..., 3:] = raw[..., :2], z.to(torch.uint8), raw[..., 2:]
    return out.view(ggml.DTYPE)


def to_q4_0(codes: torch.Tensor, scale: torch.Tensor, where: str) -> torch.Tensor:
    """codes [R, K] (value (q - 8) * scale) and scale [R, K/G] -> q4_0 blocks bits8 [R, K/32, 18], the same weights."""
    R, K = codes.shape
    if K % 32 or (K // scale.shape[1]) % 32:
        raise ModelError(f"{where}: {K} inputs in groups of {K // scale.shape[1]}: expected multiples of 32")
    d = scale.repeat_interleave((K // scale.shape[1]) // 32, dim=1)  # [R, K/32]
    d16 = d.to(torch.float16)
    if not torch.equal(d16.float(), d):
        raise ModelError(f"{where}: scales not representable in fp16 (q4_0 keeps an fp16 scale)")
    c = codes.reshape(R, K // 32, 2, 16)
    nibbles = (c[:, :, 0] | (c[:, :, 1] << 4)).to(torch.uint8)  # element j low, j + 16 high
    out = torch.empty(R, K // 32, 18, dtype=torch.uint8)
    out[..., :2] = d16.contiguous().view(torch.uint8).reshape(R, K // 32, 2)
    out[..., 2:] = nibbles
    return out.view(ggml.DTYPE)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, p: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """The float weight [R, K] of read()'s codes, scale, zeros and order: scale * (q - z) in fp32, inputs put back in
    feature order, then ``dtype``."""
    G = codes.shape[1] // scale.shape[1]
    z = 8.0 if zeros is None else zeros.float().repeat_interleave(G, dim=1)
    w = (codes.float() - z) * scale.repeat_interleave(G, dim=1)
    return (w if p is None else quant.unpermute(w, p)).to(dtype)
