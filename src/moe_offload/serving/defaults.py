"""The model's generation_config.json as the default sampling values, as vLLM's ``--generation-config auto``.

    <model dir>/generation_config.json --keys that differ from transformers' defaults--> {temperature, top_p,
        top_k, min_p, repetition_penalty, max_tokens}  --> used where a request leaves the field out

A request's own value always wins; without either, OpenAI's default applies (temperature 1.0, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_offload.errors import ConfigError

# transformers' GenerationConfig defaults: a file value equal to these is not an override (vLLM's to_diff_dict).
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0, "max_new_tokens": None}


def load(source: str, model: str = "") -> dict:
    """Default sampling values. ``source``: "auto" (the model directory's file, if any), "vllm" (none: OpenAI's
    defaults), or a directory holding generation_config.json."""
    if source == "vllm":
        return {}
    if source == "auto":
        folder = Path(model) if model else None
        if folder is None or not (folder / "generation_config.json").is_file():
            return {}
    else:
        folder = Path(source).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config: expected auto, vllm or a directory with generation_config.json, got {source!r}")
    path = folder / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    out = {}
    for key, hf_default in HF_DEFAULTS.items():
        v = raw.get(key)
        if v is None or v == hf_default or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out["max_tokens" if key == "max_new_tokens" else key] = int(v) if key in ("top_k", "max_new_tokens") else float(v)
    return out
