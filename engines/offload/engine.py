"""OffloadEngine: the Engine contract over an OffloadedModel (transformers model + offload executor).

    prompt ids --prefill(model, KV cache)--> logits --sample--> token --decode step--> ... --> stats
    stats = deltas of executor.stats over the request + wall times measured here

The decode loop is the hot path: one forward per token on a preallocated KV
cache (StaticCache: no per-step allocation), only the last position's
logits, sampling in torch with a per-request torch.Generator.
"""

from __future__ import annotations

import gc
import os
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moe_offload.engines.base import Engine, EngineInfo, Generation, GenerationStats, SamplingParams
from moe_offload.errors import ConfigError, EngineError

POLICIES = ("static", "lru", "hybrid")
BUILD_OPTIONS = ("device", "backend", "policy", "fraction", "dtype", "expert_dtype", "hybrid_threshold", "cache")
CACHES = ("static", "dynamic")


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from ``logits`` [V] (any float dtype): greedy, or temperature + top-k + top-p."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature  # [V]
    vocab = scaled.shape[-1]
    if params.top_k and params.top_k < vocab:
        values, ids = torch.topk(scaled, params.top_k)  # [k], sorted descending
    elif params.top_p < 1.0:
        values, ids = torch.sort(scaled, descending=True)  # [V]
    else:
        values, ids = scaled, None
    if params.top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = (torch.cumsum(probs, dim=-1) - probs) < params.top_p
        values, ids = values[keep], ids[keep]
    probs = torch.softmax(values, dim=-1)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(ids[choice] if ids is not None else choice)


# -- executor statistics -> GenerationStats ------------------------------------------------------------------
def _snapshot(executor) -> dict:
    stats = getattr(executor, "stats", None)
    return stats.snapshot() if stats is not None else {}


def _delta(after, before):
    """after - before over nested dicts of numbers (counters are cumulative in the executor)."""
    if isinstance(after, Mapping):
        before = before if isinstance(before, Mapping) else {}
        return {k: _delta(v, before.get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before if isinstance(before, (int, float)) else 0)
    return after


def _fill_stats(stats: GenerationStats, before: dict, after: dict) -> dict[str, int]:
    """Put this request's executor counters (after - before) into ``stats``; returns routed pairs per tier."""
    if not after:
        return {}
    d = _delta(after, before)
    stats.hits = int(d.get("hits", 0))
    stats.misses = int(d.get("misses", 0))
    stats.host_expert_tokens = int(d.get("host_expert_tokens", 0))
    stats.bytes_moved = {k: int(v) for k, v in d.get("bytes_moved", {}).items()}
    stats.stage_ms = {k: float(v) for k, v in d.get("stage_ms", {}).items()}
    pairs = _tier_pairs(d)
    routed = stats.hits + stats.misses
    stats.hit_rate_by_tier = {k: v / routed if routed else 0.0 for k, v in pairs.items()}
    return pairs


def _tier_pairs(d: dict) -> dict[str, int]:
    """Routed token-expert pairs served per tier, summed over layers."""
    pairs: dict[str, int] = {}
    for layer in d.get("layers", {}).values():
        for tier, n in layer.get("by_tier", {}).items():
            pairs[tier] = pairs.get(tier, 0) + int(n)
    return pairs


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    found: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in found:
                found.append(v)
    return tuple(found)


class OffloadEngine(Engine):
    """One OffloadedModel (or any object with ``.model``, ``.device``) plus its tokenizer (may be None)."""

    def __init__(self, offloaded, tokenizer=None, *, model_name: str = "", backend: str = "cpu", cache: str = "static"):
        if cache not in CACHES:
            raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
        self.offloaded = offloaded
        self.model = offloaded.model
        self.tokenizer = tokenizer
        self.executor = getattr(offloaded, "executor", None)
        self.device = torch.device(getattr(offloaded, "device", None) or self.model.device)
        self.cache_kind = cache
        text_config = self.model.config.get_text_config()
        placement = getattr(offloaded, "placement", None)
        self.info = EngineInfo(
            model=model_name or getattr(self.model.config, "_name_or_path", "") or "model",
            backend=backend,
            vocab_size=int(text_config.vocab_size),
            max_model_len=int(getattr(text_config, "max_position_embeddings", 0) or 2048),
            eos_token_ids=_eos_ids(self.model, tokenizer),
            policy=str(getattr(offloaded, "policy", "") or ""),
            predicted_hit_rate=dict(getattr(placement, "predicted_hit_rate", {}) or {}),
        )
        self._total = GenerationStats()
        self._tier_pairs: dict[str, int] = {}  # cumulative routed pairs served per tier
        self._closed = False

    # -- the contract -------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise ConfigError("engine is closed")
        prompt = list(prompt_ids)
        self.check_prompt(prompt, params)
        stats = GenerationStats(prompt_tokens=len(prompt))
        return Generation(self._run(prompt, params, stats), stats)

    def stats(self) -> dict[str, Any]:
        return self._total.to_dict()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self.executor, "close", None) or getattr(self.offloaded, "close", None)
        if close:
            close()
        self.model = self.offloaded = self.executor = None
        gc.collect()

    # -- the decode loop ----------------------------------------------------------------------------------
    def _new_cache(self, length: int):
        from transformers import DynamicCache, StaticCache

        config = self.model.config
        if self.cache_kind == "static":
            return StaticCache(config=config, max_cache_len=length)
        return DynamicCache(config=config)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        # ids, positions [1, T] -> logits of the last position [V]
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _run(self, prompt: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[int]:
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.info.eos_token_ids))
        before = _snapshot(self.executor)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                n = len(prompt)
                cache = self._new_cache(n + params.max_tokens)
                ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, T]
                logits = self._forward(ids, torch.arange(n, device=self.device).unsqueeze(0), cache)
                # One step's inputs, reused: no allocation per token on the host side.
                step_ids = torch.empty((1, 1), dtype=torch.long, device=self.device)
                step_pos = torch.empty((1, 1), dtype=torch.long, device=self.device)
                for i in range(params.max_tokens):
                    step0 = time.perf_counter()
                    if i > 0:
                        logits = self._forward(step_ids, step_pos, cache)
                    token = sample_token(logits, params, generator)
                    stats.record_step(i, t0, step0, time.perf_counter())
                    if token in stops:
                        stats.finish_reason = "stop"
                        return
                    stats.completion_tokens += 1
                    step_ids.fill_(token)
                    step_pos.fill_(n + i)
                    yield token
                stats.finish_reason = "length"
        except RuntimeError as e:  # torch failures (out of memory, a kernel error): the request fails, not the server
            raise EngineError(f"generation failed after {stats.completion_tokens} tokens: {e}") from e
        finally:
            self._accumulate(stats, _fill_stats(stats, before, _snapshot(self.executor)))

    def _accumulate(self, s: GenerationStats, tier_pairs: dict[str, int]) -> None:
        t = self._total
        t.add(s)
        for tier, n in tier_pairs.items():
            self._tier_pairs[tier] = self._tier_pairs.get(tier, 0) + n
        total = t.hits + t.misses
        t.hit_rate_by_tier = {k: v / total if total else 0.0 for k, v in self._tier_pairs.items()}


# -- building -----------------------------------------------------------------------------------------------
def _resolve_placement(path: Path, placement, fraction, policy: str, backend: str):
    from rm_core import Placement

    if placement is not None and fraction is not None:
        raise ConfigError("give either a placement or a fraction, not both")
    if isinstance(placement, Placement):
        return placement
    if isinstance(placement, (str, os.PathLike)):
        file = Path(placement).expanduser()
        if not file.is_file():
            raise ConfigError(f"placement: expected a placement JSON file, got {str(file)!r} (not found)")
        try:
            return Placement.from_json(file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"placement {file}: not a valid placement JSON ({e})") from None
    if placement is not None:
        raise ConfigError(f"placement: expected an rm_core.Placement or a JSON file path, got {type(placement).__name__}")
    fraction = 1.0 if fraction is None else fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"fraction: expected a number in 0..1, got {fraction!r}")
    from moe_offload import placement as plan
    from moe_offload.backends import get_backend
    from moe_offload.spec import ModelSpec

    spec = ModelSpec.from_hf_config(str(path))
    slots = plan.fraction_slots(spec, float(fraction))
    return plan.from_fraction(spec, get_backend(backend).tiers(), float(fraction), plan.for_miss_policy(policy, slots, spec.num_experts))


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
    cache: str = "static",
    expert_dtype: str | None = None,
    **unknown,
) -> OffloadEngine:
    """Load ``model_path`` (default: the demo model, built on first use) with the offload executor.

    placement: an rm_core.Placement, a placement JSON path, or None (then ``fraction`` 0..1 of each layer's
    experts get accelerator slots, default 1.0). policy: static | lru | hybrid. dtype: "bfloat16" |
    "float32" | "float16" | None (the checkpoint's). hybrid_threshold: tokens per expert and step from
    which hybrid fetches. cache: the KV cache, "static" (preallocated) or "dynamic". expert_dtype: "int8" |
    "fp8" | "bf16" | None (experts as the checkpoint stores them; see loader.load_model).
    """
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(sorted(unknown))}; valid: {', '.join(BUILD_OPTIONS)}")
    if policy not in POLICIES:
        raise ConfigError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if cache not in CACHES:
        raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    from moe_offload.engines.offload.loader import check_checkpoint, load_model

    if model_path is None:
        from moe_offload.demo import ensure_demo_model

        model_path = ensure_demo_model()
    path = check_checkpoint(str(Path(model_path).expanduser()))
    resolved = _resolve_placement(path, placement, fraction, policy, backend)
    offloaded = load_model(
        str(path), resolved, policy=policy, device=device, dtype=dtype, hybrid_threshold=hybrid_threshold,
        expert_dtype=expert_dtype,
    )
    return OffloadEngine(offloaded, load_tokenizer(path), model_name=str(path), backend=backend, cache=cache)


__all__ = ["OffloadEngine", "build_offload_engine", "load_tokenizer", "sample_token"]
