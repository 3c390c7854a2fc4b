"""What a checkpoint holds, before anything loads: its files, its experts modules, what each expert weighs.

    checkpoint dir --check_checkpoint--> config.json + every safetensors shard present (ModelError otherwise)
      --inspect_checkpoint--> (transformers config, [ExpertsInfo(name, layer, num_experts, expert_bytes)], dense bytes)
         built on the meta device (no memory), each expert priced as the store will hold it (quant.weight_bytes)

The control plane resolves a placement from these numbers (control/resolve.py); the loader then loads to match.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_offload.engines.offload.experts.store import module_tensor_names
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.loading import architecture, checkpoint, quant
from moe_offload.errors import ConfigError, ModelError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ExpertsInfo:
    """An experts module found on the meta model: where it is and what one of its experts weighs."""

    name: str
    layer: int
    num_experts: int
    expert_bytes: int


def compute_dtype_of(config, dtype: str | None) -> torch.dtype | None:
    """The dtype the model computes in: ``dtype`` (a DTYPES name), else what from_pretrained loads (the config's)."""
    cfg_dtype = getattr(config, "dtype", None)
    return DTYPES[dtype] if dtype else (cfg_dtype if isinstance(cfg_dtype, torch.dtype) else None)


def check_checkpoint(path: str) -> Path:
    """A directory with config.json and every safetensors shard its index names; for a GGUF file (or a directory
    holding one) the directory of its config.json and tokenizer (gguf_load.view_dir); else ModelError."""
    from moe_offload.control import gguf_meta

    if gguf_meta.is_gguf(path):
        from moe_offload.engines.offload.loading.gguf_load import view_dir

        return view_dir(path)
    root = Path(path)
    if not root.is_dir():
        raise ModelError(f"model: expected a checkpoint directory, got {path!r} (not a directory)")
    if not (root / "config.json").is_file():
        raise ModelError(f"{root}: expected config.json in the checkpoint directory, found none")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelError(f"{index}: expected a JSON object with a weight_map, got an unreadable file ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ModelError(f"{root}: missing {len(missing)} of {len(shards)} safetensors shards named by the index: {', '.join(missing[:3])}")
    elif not any(root.glob("*.safetensors")) and "gguf_file" not in json.loads((root / "config.json").read_text()):
        raise ModelError(f"{root}: expected model.safetensors or a sharded index, found no safetensors files")
    return root


_INSPECTED: dict[tuple, tuple] = {}  # (path, config mtime, dtype) -> inspect_checkpoint's answer; the last few


def inspect_checkpoint(root: str | Path, dtype: str | None = None, expert_dtype: str | None = None
                       ) -> tuple[Any, list[ExpertsInfo], int]:
    """(transformers config, experts modules, non-expert bytes) of checkpoint ``root`` loaded in ``dtype``
    (None: the checkpoint's), each expert priced as the store will hold it (its quantized format, or
    ``expert_dtype``). ModelError for a config transformers cannot read or a model without experts.
    Remembered per path, config.json mtime and dtype: building an engine asks for its placement and again for
    loading, and the meta model need not be built twice."""
    root = Path(root)
    key = (str(root), (root / "config.json").stat().st_mtime_ns, dtype, expert_dtype)
    if key in _INSPECTED:
        return _INSPECTED[key]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(root)
    except (ValueError, OSError, KeyError) as e:
        raise ModelError(f"{root}: config.json cannot be read by transformers: {e}") from None
    torch_dtype = compute_dtype_of(config, dtype)
    method = checkpoint.quant_method(config, str(root))
    read_as, convert_to = expert_target(method, expert_dtype, gguf=getattr(config, "gguf_file", None) is not None)
    priced_as = convert_to or (checkpoint.STORED_FORMAT.get(method, method) if read_as == "stored" else "bfloat16")
    experts, dense_bytes = inspect_model(config, torch_dtype, priced_as)
    if not experts:
        raise ModelError(f"{root}: dense model (model_type {config.model_type!r}): no routed experts modules to offload")
    if getattr(config, "gguf_file", None) is not None and read_as == "stored":  # priced as the file stores them
        from dataclasses import replace

        from moe_offload.control import gguf_meta

        exact = gguf_meta.read(config.gguf_file).layer_expert_bytes()
        experts = [replace(i, expert_bytes=exact[i.layer]) for i in experts]
    while len(_INSPECTED) >= 4:
        _INSPECTED.pop(next(iter(_INSPECTED)))
    _INSPECTED[key] = (config, experts, dense_bytes)
    return config, experts, dense_bytes


def expert_target(method: str | None, expert_dtype: str | None, gguf: bool = False) -> tuple[str, str | None]:
    """(how a quantized checkpoint's experts are read: "stored" | "float" (dequantized to bf16), what the store is
    converted to: None | "int8" | "fp8" | "q4_0" (int4) | "bfloat16") for checkpoint quant ``method`` and
    ``--expert-dtype``. ``gguf``: a GGUF file, whose experts are kept in their quant types or dequantized (bf16)."""
    from moe_offload.control.vocab import EXPERT_DTYPES

    if expert_dtype is None:
        return "stored", None
    if gguf:
        if expert_dtype != "bf16":
            raise ConfigError(f"expert_dtype {expert_dtype!r}: a GGUF file's experts stay in its quant types; expected "
                              "bf16 (dequantize at load) or unset (keep them as stored)")
        return "float", None
    if method is None:
        return "stored", EXPERT_DTYPES[expert_dtype]
    if expert_dtype == "bf16":
        return "float", None
    if expert_dtype == method or EXPERT_DTYPES[expert_dtype] == checkpoint.STORED_FORMAT.get(method):
        return "stored", None
    raise ConfigError(f"expert_dtype {expert_dtype!r}: this checkpoint's experts are {method}; expected bf16 "
                      f"(dequantize at load) or {method} / unset (keep them as stored)")


def find_experts(config, dtype: torch.dtype | None = None) -> list[ExpertsInfo]:
    """Experts modules of the model ``config`` describes, found on the meta device (no memory)."""
    return inspect_model(config, dtype)[0]


def inspect_model(config, dtype: torch.dtype | None = None, fmt: str | None = None) -> tuple[list[ExpertsInfo], int]:
    """(experts modules the executor serves, bytes of all other parameters of the text path) of the model
    ``config`` describes, built on the meta device with the class ``load_model`` loads it with. ``fmt`` ("int8" |
    "fp8" | "mxfp4" | a float dtype name): price each expert as stored in it (default: ``dtype``)."""
    cls = architecture.model_class(config)
    if architecture.text_only(config):
        config = copy.deepcopy(config)
        for k, v in architecture.text_only(config).items():
            setattr(config, k, v)
    try:
        with torch.device("meta"):
            meta = cls._from_config(config, **({"dtype": dtype} if dtype else {}))
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ModelError(f"model_type {config.model_type!r}: transformers cannot build {cls.__name__} from this config: {e}") from None
    model = architecture.text_path(meta)
    found = []
    routed = 0  # bytes of the routed experts as the meta model holds them (float)
    for e in architecture.experts_modules(model)[0]:
        tensors = [getattr(e.module, n) for n in module_tensor_names(e.module) if n is not None]
        nbytes = sum(t[0].numel() * t.element_size() for t in tensors)
        routed += nbytes * tensors[0].shape[0]
        if fmt is not None:
            nbytes = priced_expert_bytes(e.module, tensors, fmt)
        found.append(ExpertsInfo(e.name, e.layer, int(tensors[0].shape[0]), nbytes))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return found, total - routed


def priced_expert_bytes(module, tensors: list, fmt: str) -> int:
    """Bytes of one expert of ``module`` (meta ``tensors``: up, down, biases) stored in ``fmt``: a quantized format
    (weights; biases keep their dtype) or a float dtype name."""
    up, down, *biases = tensors
    bias = sum(b[0].numel() * b.element_size() for b in biases)
    float_bytes = torch.empty((), dtype=getattr(torch, fmt)).element_size() if fmt not in quant.QUANTIZED else 0
    total = bias  # biases keep their dtype in every format
    for i, w in enumerate((up, down)):
        R, K = (w.shape[2], w.shape[1]) if module.is_transposed else (w.shape[1], w.shape[2])
        if fmt in quant.ggml.BY_NAME and K % quant.ggml.BY_NAME[fmt].block:
            raise ConfigError(f"expert_dtype int4: groups of {quant.ggml.BY_NAME[fmt].block} weights need expert input "
                              f"sizes divisible by it; this model's experts read {K} features "
                              f"({'gate_up' if i == 0 else 'down'})")
        split = dispatch.gate_up_split(module, R) if i == 0 and fmt == "fp8" else 0
        total += quant.weight_bytes(fmt, R, K, split, float_bytes)
    return total
