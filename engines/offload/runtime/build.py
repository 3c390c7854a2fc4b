"""Building an OffloadEngine from a checkpoint directory.

    options (BUILD_OPTIONS) --checked before anything loads--> KVCacheConfig, SchedulerConfig
    model_path (default: the demo model) --check_checkpoint--> path
      --inspect_checkpoint (MoE layers, experts per layer) + ModelSpec + the backend's tiers-->
      control.resolve.resolve_placement(placement | fraction, policy) --> rm_core.Placement
      --loader.load_model (policy, device, dtypes)--> OffloadedModel + tokenizer --> OffloadEngine
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moe_offload.engines.offload.experts.policies import check_policy
from moe_offload.engines.offload.runtime.engine import CACHES, OffloadEngine
from moe_offload.engines.offload.runtime.kv_budget import KVCacheConfig
from moe_offload.engines.offload.runtime.scheduler import SchedulerConfig
from moe_offload.errors import ConfigError

BUILD_OPTIONS = ("device", "backend", "policy", "fraction", "dtype", "expert_dtype", "dense_dtype", "hybrid_threshold", "cache",
                 "block_size",
                 "kv_cache_memory", "max_model_len", "max_num_seqs", "max_num_batched_tokens")


def _placement(path: Path, placement, fraction, policy: str, backend: str, dtype: str | None = None):
    """control.resolve with what it needs from this checkpoint and backend (read only when a fraction decides)."""
    from moe_offload.control.resolve import resolve_placement

    def spec():
        from moe_offload.control.spec import ModelSpec
        from moe_offload.engines.offload.loading.inspection import inspect_checkpoint

        # The MoE layers are those whose experts modules the model builds (what load_model will offload).
        experts = inspect_checkpoint(path, dtype)[1]
        return dataclasses.replace(ModelSpec.from_hf_config(str(path)), moe_layers=tuple(i.layer for i in experts),
                                   num_experts=experts[0].num_experts)

    def tiers():
        from moe_offload.backends import get_backend

        return get_backend(backend).tiers()

    return resolve_placement(placement, fraction, policy, spec=spec, tiers=tiers)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when the directory has none (the engine then works on ids only)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_offload_engine(
    model_path=None,
    placement=None,
    *,
    device: str = "cpu",
    backend: str = "cpu",
    policy: str = "static",
    fraction: float | None = None,
    dtype: str | None = None,
    hybrid_threshold: int | None = None,
    cache: str = "paged",
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    expert_dtype: str | None = None,
    dense_dtype: str | None = None,
    **unknown,
) -> OffloadEngine:
    """Load ``model_path`` (default: the demo model, built on first use) with the offload executor.

    placement: an rm_core.Placement, a placement JSON path, or None (then ``fraction`` 0..1 of each layer's
    experts get accelerator slots, default 1.0). policy: static | lru | hybrid. dtype: "bfloat16" |
    "float32" | "float16" | None (the checkpoint's). hybrid_threshold: tokens per expert and step from
    which hybrid fetches. cache: "paged" (block pool, batched steps) or "dynamic" (per sequence, the model's own
    cache). block_size, kv_cache_memory (bytes), max_model_len, max_num_seqs, max_num_batched_tokens: the KV
    budget and the scheduler, as vLLM names them (KVCacheConfig, SchedulerConfig). expert_dtype: "int8" | "fp8" | "bf16" | None
    (experts as the checkpoint stores them; see loader.load_model). dense_dtype: "int8" | "bf16" | None (attention
    projections and LM head; see loader.load_model).
    """
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(sorted(unknown))}; valid: {', '.join(BUILD_OPTIONS)}")
    check_policy(policy)
    if cache not in CACHES:
        raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
    kv_config = KVCacheConfig(block_size, kv_cache_memory, max_model_len)  # validated before the model loads
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    from moe_offload.engines.offload.loading.inspection import check_checkpoint
    from moe_offload.engines.offload.loading.loader import load_model

    if model_path is None:
        from moe_offload.demo import ensure_demo_model

        model_path = ensure_demo_model()
    path = check_checkpoint(str(Path(model_path).expanduser()))
    resolved = _placement(path, placement, fraction, policy, backend, dtype)
    offloaded = load_model(
        str(path), resolved, policy=policy, device=device, dtype=dtype, hybrid_threshold=hybrid_threshold,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype,
    )
    return OffloadEngine(offloaded, load_tokenizer(path), model_name=str(path), backend=backend, cache=cache,
                         kv_config=kv_config, scheduler=sched)


__all__ = ["BUILD_OPTIONS", "build_offload_engine", "load_tokenizer"]
