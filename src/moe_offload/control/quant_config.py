"""Quantized releases whose configs the control plane reads as the engine loads them (no torch): which 4-bit
safetensors layouts are supported (engines/offload/loading/int4.py repacks them into q4_0 blocks, those with zero points
(AWQ, GPTQ sym=false, asymmetric compressed-tensors) into q4_z), and ModelOpt NVFP4 (loading/nvfp4.py: nvfp4 blocks)."""

from __future__ import annotations

from typing import Any

from moe_offload.errors import ModelError

INT4_METHODS = ("gptq", "compressed-tensors", "awq")
MODELOPT_METHODS = ("modelopt", "modelopt_fp4")  # ModelOpt's quant_method spellings (hf_quant_config.json's producer)
NVFP4_GROUP = 16  # values per e4m3 block scale
# compressed-tensors' ActivationOrdering (quant_args.py; static = weight, dynamic = group, True = group): weight keeps
# the groups consecutive, group stores a g_idx (read as GPTQ's act-order, loading/int4.py)
ACTORDER = (None, False, True, "weight", "static", "group", "dynamic")


def check_int4(qc: dict[str, Any], where: str) -> None:
    """ModelError unless ``qc`` describes 4-bit weights in groups of a multiple of 32: symmetric (GPTQ,
    compressed-tensors) or with a zero point per group (AWQ's GEMM layout, GPTQ sym=false, compressed-tensors
    symmetric=false)."""
    method = qc.get("quant_method")
    if method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or not qc.get("zero_point", True) or version != "gemm":
            raise ModelError(f"{where}: AWQ with bits={bits} zero_point={qc.get('zero_point', True)} "
                             f"version={version!r} is not supported; expected 4-bit, zero points, the gemm layout")
    elif method == "gptq":
        bits, group, sym = qc.get("bits"), qc.get("group_size", 128), qc.get("sym", True)
        fmt = qc.get("checkpoint_format", "gptq")
        if bits != 4 or fmt != "gptq":
            raise ModelError(f"{where}: GPTQ with bits={bits} checkpoint_format={fmt!r} is not supported; expected "
                             "4-bit, the gptq (v1) format")
    else:
        groups = list((qc.get("config_groups") or {}).values())
        w = _ct_weights(qc)
        bits, group, sym = w.get("num_bits"), w.get("group_size"), w.get("symmetric", True)
        if (qc.get("format") != "pack-quantized" or bits != 4 or sym not in (True, False) or w.get("type") != "int"
                or w.get("strategy") not in ("group", "channel") or w.get("actorder") not in ACTORDER):
            raise ModelError(f"{where}: compressed-tensors {qc.get('format')!r} with {len(groups)} config group(s), "
                             f"weights {w} is not supported; expected one group of 4-bit int weights (symmetric or "
                             "not, group or channel strategy, actorder none, weight or group), pack-quantized")
        group = group or -1
    if group not in (-1, None) and group % 32:
        raise ModelError(f"{where}: 4-bit group size {group} is not supported; expected a multiple of 32 (or per channel)")


def has_zero_points(qc: dict[str, Any]) -> bool:
    """The 4-bit release keeps a zero point per group (AWQ, GPTQ sym=false, compressed-tensors symmetric=false): held
    as q4_z blocks, else q4_0."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _ct_weights(qc).get("symmetric", True) is False
    return method == "awq" or (method == "gptq" and not qc.get("sym", True))


def _ct_weights(qc: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors config's weight arguments: those of its one config group, {} unless exactly one."""
    groups = list((qc.get("config_groups") or {}).values())
    return (groups[0].get("weights") or {}) if len(groups) == 1 else {}


def act_order(qc: dict[str, Any]) -> bool:
    """The 4-bit release quantized its inputs in a permuted order and stores it (GPTQ desc_act without static
    groups, compressed-tensors actorder group): the engine keeps the order beside each projection's blocks."""
    method = qc.get("quant_method")
    if method == "gptq":
        return bool(qc.get("desc_act")) and not qc.get("static_groups", False)
    if method == "compressed-tensors":
        return _ct_weights(qc).get("actorder") in (True, "group", "dynamic")
    return False


def is_nvfp4(qc: dict[str, Any], where: str) -> bool:
    """The config names a ModelOpt release (quant_method "modelopt" / "modelopt_fp4"): True for NVFP4 weights in
    groups of 16 (e2m1 values, an e4m3 scale per 16, an fp32 scale per tensor); ModelError for another ModelOpt
    algorithm or group; False for any other method."""
    if qc.get("quant_method") not in MODELOPT_METHODS:
        return False
    algo = qc.get("quant_algo")
    groups = list((qc.get("config_groups") or {}).values())
    group = qc.get("group_size", ((groups[0].get("weights") or {}).get("group_size") if len(groups) == 1 else None))
    if algo != "NVFP4" or group not in (None, NVFP4_GROUP):
        raise ModelError(f"{where}: ModelOpt quant_algo={algo!r} group_size={group!r} is not supported; expected NVFP4 "
                         f"in groups of {NVFP4_GROUP} (MIXED_PRECISION and FP8 releases are not read)")
    return True
