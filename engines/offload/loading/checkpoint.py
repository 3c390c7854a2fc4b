"""A quantized checkpoint's routed experts, read as stored; everything else handed to transformers.

    config.quantization_config --quant_method--> "mxfp4" (gpt-oss) | "fp8" (DeepSeek-V3 style 128x128 blocks) |
        a 4-bit method (int4.py) | "nvfp4" (ModelOpt quant_algo NVFP4, nvfp4.py)
    safetensors keys --transformers' conversion mapping (renamings, per-expert converters)--> which keys feed which
        experts module's gate_up / down: fused [E, ...] tensors, or one tensor per expert (gate, up concatenated)
      -> experts: read one layer at a time, kept in the stored format (or dequantized for --expert-dtype bf16)
         into the tensors of a LayerStore: (up, down, up_bias, down_bias, up_scale, down_scale)
      -> the rest: a state dict for from_pretrained (lazy safetensors slices; FP8 linears dequantized to the
         compute dtype) with zero-stride placeholders for the experts' own weights, so transformers neither
         reads nor allocates them (its missing-key path would allocate and initialise full-size tensors)

Why not transformers' quantizers: they dequantize every expert (Mxfp4Config / FineGrainedFP8Config with
dequantize=True, the tests' reference) or need GPU kernels; here the experts stay as stored, so the host store
and the slots hold, and a fetch moves, the checkpoint's bytes. FP8 blocks are DeepSeek's: 128x128 from the top
left, the last block of a dimension that is not a multiple of 128 is partial.

Legend: E experts, H hidden, I expert intermediate, R output rows, K input features.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_offload.control.quant_config import check_int4, has_zero_points, is_nvfp4
from moe_offload.engines.offload.loading import int4, nvfp4, quant
from moe_offload.errors import ModelError

METHODS = ("mxfp4", "fp8", *int4.METHODS, "nvfp4")
# the format a method's experts are stored in by this loader (int4.py repacks 4-bit releases as q4_0 blocks, those
# with zero points (AWQ, GPTQ sym=false: "gptq_zp", asymmetric compressed-tensors: "compressed-tensors_zp") as q4_z)
STORED_FORMAT = {"mxfp4": "mxfp4", "fp8": "fp8", "nvfp4": "nvfp4", **dict.fromkeys(int4.METHODS, "q4_0"),
                 **dict.fromkeys(("awq", "gptq_zp", "compressed-tensors_zp"), "q4_z")}
SCALE_SUFFIX = "_scale_inv"  # fp8: "<linear>.weight" -> "<linear>.weight_scale_inv"


def quant_method(config, where: str = "checkpoint") -> str | None:
    """"mxfp4" | "fp8" | a 4-bit method (int4.METHODS; "gptq_zp": GPTQ with sym=false, "compressed-tensors_zp":
    compressed-tensors with symmetric=false) for a checkpoint this loader reads quantized, None for a float one;
    ModelError otherwise."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if is_nvfp4(qc, where):
        return "nvfp4"
    method = str(qc.get("quant_method", ""))
    if method not in METHODS or method.endswith("_zp") or method == "nvfp4":  # "nvfp4" is this loader's name  # the _zp names are this loader's, never a config's
        raise ModelError(f"{where}: quantization_config.quant_method {method!r} is not supported; expected one of "
                         f"{', '.join(m for m in METHODS if not m.endswith('_zp') and m != 'nvfp4')}, modelopt (gpt-oss "
                         "MXFP4, DeepSeek-style block FP8, 4-bit GPTQ, compressed-tensors or AWQ, ModelOpt NVFP4) or "
                         "an unquantized checkpoint")
    if method in int4.METHODS:
        check_int4(qc, where)
        if method in ("gptq", "compressed-tensors") and has_zero_points(qc):
            method += "_zp"
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or list(block) != [quant.FP8_BLOCK, quant.FP8_BLOCK]:
            raise ModelError(f"{where}: FP8 weight_block_size {block!r} is not supported; expected [128, 128]")
        if str(qc.get("fmt", "e4m3")) not in ("e4m3", "float8_e4m3fn") or qc.get("scale_fmt", "float") != "float" \
                or qc.get("expert_dtype", "fp8") != "fp8":
            raise ModelError(f"{where}: FP8 checkpoint with fmt={qc.get('fmt')!r} scale_fmt={qc.get('scale_fmt')!r} "
                             f"expert_dtype={qc.get('expert_dtype')!r}; expected e4m3 weights with float block scales")
    return method


class Files:
    """The checkpoint's safetensors files, open for the duration of a load: key -> lazy slice or tensor."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for f in sorted(Path(root).glob("*.safetensors")):
            h = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for k in h.keys():
                self._where[k] = h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def slice(self, key: str):
        return self._where[key].get_slice(key)

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self._where[key].get_tensor(key)
        except KeyError:
            raise ModelError(f"checkpoint: expected tensor {key!r}, not found in its safetensors files") from None


@dataclass
class Projection:
    """Where one projection (up or down) of an experts module lives in the checkpoint."""

    fused: str | None = None  # one [E, ...] key (float) or the "<param>" prefix of mxfp4 _blocks/_scales
    parts: dict[int, dict[int, str]] = field(default_factory=dict)  # per expert: part (0 gate, 1 up) -> key
    nparts: int = 1


@dataclass
class ExpertSources:
    up: Projection
    down: Projection

    def keys(self, method: str | None) -> set[str]:
        """Every checkpoint key these experts' weights are read from (biases excluded: transformers loads them)."""
        out = set()
        for p in (self.up, self.down):
            if p.fused is not None:
                out |= {p.fused + "_blocks", p.fused + "_scales"} if method == "mxfp4" else {p.fused}
            for per in p.parts.values():
                for k in per.values():
                    out.add(k)
                    if method == "fp8":
                        out.add(k + SCALE_SUFFIX)
                    if method == "nvfp4":
                        out |= set(nvfp4.beside(k))
                    if method in int4.METHODS:
                        base = k.removesuffix(int4.WEIGHT[method])
                        out |= {base + x for x in int4.BESIDE[method]}
        return out


def find_sources(meta_model, experts: list, keys: list[str], method: str | None) -> dict[str, ExpertSources]:
    """{experts module name: its sources} for ``experts`` (inspection.ExpertsInfo) among the checkpoint ``keys``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    modules = dict(meta_model.named_modules())
    conversions = get_model_conversion_mapping(meta_model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_sd = {k: None for k in meta_model.state_dict()}
    from moe_offload.engines.offload.experts.store import module_tensor_names

    wanted = {}  # "<module>.<param>" -> (module name, 0 up | 1 down)
    out = {}
    for info in experts:
        up_name, down_name = module_tensor_names(modules[info.name])[:2]
        wanted[f"{info.name}.{up_name}"] = (info.name, 0)
        wanted[f"{info.name}.{down_name}"] = (info.name, 1)
        out[info.name] = ExpertSources(Projection(), Projection())
    for key in keys:
        if (method == "fp8" and key.endswith(SCALE_SUFFIX)) or (method == "nvfp4" and nvfp4.is_beside(key)):
            continue  # found through its weight
        packed = key
        if method in int4.METHODS:  # "<linear>.qweight" / ".weight_packed" stands for "<linear>.weight"
            if not key.endswith(int4.WEIGHT[method]):
                continue
            key = key.removesuffix(int4.WEIGHT[method]) + ".weight"
        if method == "mxfp4" and (key.endswith("_blocks") or key.endswith("_scales")):
            target = key.rsplit("_", 1)[0]
            if target in wanted:
                name, which = wanted[target]
                _proj(out[name], which).fused = target
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, meta_model.base_model_prefix, meta_sd)
        if renamed not in wanted:
            continue
        name, which = wanted[renamed]
        proj = _proj(out[name], which)
        if pattern is None:
            proj.fused = packed
            continue
        conv = by_pattern[pattern]
        _check_ops(conv, renamed)
        match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if match is None or not match.groups():
            raise ModelError(f"checkpoint key {key!r}: expected an expert index where {pattern!r} has '*'")
        proj.nparts = len(conv.source_patterns)
        proj.parts.setdefault(int(match.group(1)), {})[conv.source_patterns.index(pattern)] = packed
    for info in experts:
        for which, proj in ((0, out[info.name].up), (1, out[info.name].down)):
            if proj.fused is None and sorted(proj.parts) != list(range(info.num_experts)):
                what = ("gate_up", "down")[which]
                raise ModelError(f"{info.name}: expected the {what} weights of {info.num_experts} experts in the checkpoint, "
                                 f"found {len(proj.parts)}")
    return out


def _proj(src: ExpertSources, which: int) -> Projection:
    return src.up if which == 0 else src.down


def _check_ops(conv, target: str) -> None:
    """Per-expert tensors are stacked (MergeModulelist dim 0) and, for gate|up, concatenated along dim 1: the only
    conversions this reader reproduces; anything else is refused rather than misread."""
    names = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
    if names not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        raise ModelError(f"{target}: the checkpoint's per-expert tensors are converted by {names}; this loader reads "
                         "stacked (and gate|up concatenated) experts only")


# ---- reading one layer ---------------------------------------------------------------------------------------------
def read_layer(files: Files, src: ExpertSources, module, num_experts: int, method: str, target: str,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(up, down, up_scale, down_scale) of one layer from a quantized checkpoint.

    ``target`` "stored": as the checkpoint stores them ([E, R, ...] quantized, scales beside); "float": dequantized to
    ``dtype`` in the module's own layout ([E, H, 2I] for transposed families), scales None."""
    from moe_offload.engines.offload.kernels.dispatch import gate_up_split

    out = []
    for which, proj in ((0, src.up), (1, src.down)):
        if method == "mxfp4":
            blocks = files.tensor(proj.fused + "_blocks")  # [E, R, K/32, 16]
            w, s = blocks.reshape(*blocks.shape[:2], -1), files.tensor(proj.fused + "_scales")  # [E, R, K/2], [E, R, K/32]
            split = 0
        elif method in int4.METHODS:
            (w, s), split = _stack_int4(files, proj, num_experts, method), 0  # s: act-order permutations
        elif method == "nvfp4":
            if proj.fused is not None:
                raise ModelError(f"{proj.fused}: expected one NVFP4 tensor per expert, found a fused tensor")
            (w, s), split = nvfp4.stack(files, [[proj.parts[e][i] for i in range(proj.nparts)]
                                                for e in range(num_experts)]), 0  # s: the tensor scales per row
        else:
            w, s = _stack_fp8(files, proj, num_experts)
            split = gate_up_split(module, w.shape[1]) if which == 0 and proj.nparts == 2 else 0
        if target == "float":
            f = torch.stack([quant.dequantize(w[e], s[e] if s is not None else None, split, dtype)
                             for e in range(num_experts)])  # [E, R, K]
            out.append((f.transpose(1, 2).contiguous() if module.is_transposed else f, None))
        else:
            out.append((w.contiguous(), s.contiguous() if s is not None else None))
    (up, up_s), (down, down_s) = out
    return up, down, up_s, down_s


def _stack_int4(files: Files, proj: Projection, num_experts: int, method: str
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([E, R, K/32, S] q4_0 (or q4_z) blocks, int32 [E, K] act-order permutations or None) of a 4-bit release's
    per-expert linears (a gate|up pair: rows concatenated, one permutation for both: they quantized the same inputs)."""
    if proj.fused is not None:
        raise ModelError(f"{proj.fused}: expected one 4-bit tensor per expert, found a fused tensor")
    blocks, perms = [], []
    for e in range(num_experts):
        parts, orders = [], []
        for i in range(proj.nparts):
            prefix = proj.parts[e][i].removesuffix(int4.WEIGHT[method])
            codes, scale, zeros, p = int4.read(files, prefix, method)
            parts.append(int4.to_blocks(codes, scale, zeros, prefix))
            orders.append(torch.arange(codes.shape[1], dtype=torch.int32) if p is None else p)
        if any(not torch.equal(o, orders[0]) for o in orders[1:]):
            raise ModelError(f"{proj.parts[e][0]}, {proj.parts[e][1]}: act-order permutations differ between the "
                             "two halves of one gate|up; expected one order for the inputs they share")
        blocks.append(torch.cat(parts, dim=0))
        perms.append(orders[0])
    identity = torch.arange(perms[0].numel(), dtype=torch.int32)
    return torch.stack(blocks), (None if all(torch.equal(p, identity) for p in perms) else torch.stack(perms))


def _stack_fp8(files: Files, proj: Projection, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, K] e4m3 and [E, RB, CB] scales; a gate|up pair concatenates rows (and block rows)."""
    if proj.fused is not None:
        raise ModelError(f"{proj.fused}: expected one FP8 tensor per expert (DeepSeek layout), found a fused tensor")
    ws, ss = [], []
    for e in range(num_experts):
        parts = [proj.parts[e][i] for i in range(proj.nparts)]
        w = [files.tensor(k) for k in parts]
        s = [files.tensor(k + SCALE_SUFFIX) for k in parts]
        for k, t, sc in zip(parts, w, s):
            if t.dtype != torch.float8_e4m3fn:
                raise ModelError(f"{k}: expected float8_e4m3fn, got {t.dtype}")
            R, K = t.shape
            want = (-(-R // quant.FP8_BLOCK), -(-K // quant.FP8_BLOCK))
            if tuple(sc.shape) != want:
                raise ModelError(f"{k}{SCALE_SUFFIX}: expected block scales {list(want)} for a [{R}, {K}] weight, got {list(sc.shape)}")
        ws.append(torch.cat(w, dim=0))
        ss.append(torch.cat([sc.float() for sc in s], dim=0))
    return torch.stack(ws), torch.stack(ss)


# ---- everything else: a state dict for from_pretrained ---------------------------------------------------------------
def rest_state_dict(files: Files, skip: set[str], method: str, dtype: torch.dtype) -> dict:
    """Every key not in ``skip``: lazy slices, except FP8 linears (weight + weight_scale_inv), 4-bit linears
    (int4.py) and NVFP4 linears (nvfp4.py), dequantized to ``dtype``."""
    sd = {}
    for key in files.keys():
        if key in skip or (method == "fp8" and key.endswith(SCALE_SUFFIX)):
            continue
        if method in int4.METHODS and any(key.endswith(x) for x in int4.BESIDE[method]):
            continue  # read with its packed weight
        if method == "nvfp4" and nvfp4.is_beside(key):
            continue
        if method == "nvfp4" and nvfp4.is_nvfp4_weight(files, key):  # another NVFP4 linear: dequantized
            sd[key] = nvfp4.dequantize(*nvfp4.read(files, key), dtype)
            continue
        if method in int4.METHODS and key.endswith(int4.WEIGHT[method]):  # another 4-bit linear: dequantized
            prefix = key.removesuffix(int4.WEIGHT[method])
            codes, scale, zeros, p = int4.read(files, prefix, method)
            sd[prefix + ".weight"] = int4.dequantize(codes, scale, zeros, p, dtype)
            continue
        if method == "fp8" and key + SCALE_SUFFIX in files:
            sd[key] = quant.dequantize_fp8(files.tensor(key), files.tensor(key + SCALE_SUFFIX).float(), 0, dtype)
        else:
            sd[key] = files.slice(key)
    return sd


def placeholders(meta_model, experts: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero-stride stand-ins (no memory) for the experts' weight parameters, under their model names."""
    from moe_offload.engines.offload.experts.store import module_tensor_names

    modules = dict(meta_model.named_modules())
    out = {}
    for info in experts:
        m = modules[info.name]
        for name in module_tensor_names(m)[:2]:
            shape = getattr(m, name).shape
            out[f"{info.name}.{name}"] = torch.zeros((), dtype=dtype).expand(shape)
    return out
