"""Building an OffloadEngine from a checkpoint directory.

    options (BUILD_OPTIONS) --checked before anything loads--> KVCacheConfig, SchedulerConfig
    model_path (default: the demo model) --check_checkpoint--> path
      --inspect_checkpoint (MoE layers, experts per layer) + ModelSpec + the backend's tiers-->
      control.resolve.resolve_placement(placement | fraction, policy) --> rm_core.Placement
      --loader.load_model (policy, device, dtypes)--> OffloadedModel + tokenizer --> OffloadEngine
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from moe_offload.engines.offload.experts.policies import check_policy
from moe_offload.engines.offload.runtime.engine import CACHES, OffloadEngine
from moe_offload.engines.offload.runtime.kv_budget import DEFAULT_KV_HOST, KVCacheConfig
from moe_offload.engines.offload.runtime.scheduler import SchedulerConfig
from moe_offload.engines.params import SpeculativeConfig
from moe_offload.errors import ConfigError, require_count

BUILD_OPTIONS = ("device", "backend", "policy", "fraction", "dtype", "expert_dtype", "dense_dtype", "hybrid_threshold", "cache",
                 "host_memory", "prefetch",
                 "block_size",
                 "kv_cache_memory", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "speculative",
                 "tail_skip", "cold_dtype", "devices", "tensor_parallel", "enable_prefix_caching", "kv_events",
                 "kv_cache_dtype")


def _placement(path: Path, placement, fraction, policy: str, backend: str, dtype: str | None = None, devices=None):
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
        from moe_offload.engines.offload.loading.devices import device_tiers

        found = get_backend(backend).tiers()
        return device_tiers(devices, found) if devices else found

    return resolve_placement(placement, fraction, policy, spec=spec, tiers=tiers, devices=devices)


FLOOR_CONTEXT = 4096  # tokens of the smallest KV budget when max_model_len is not given (capped by the model's)


def _check_parallel(tensor_parallel, device: str, devices, tail_skip) -> int:
    """The number of ranks (1: one process); ConfigError for what expert parallel does not combine with."""
    if tensor_parallel is None or tensor_parallel == 1:
        return 1
    require_count("tensor_parallel", tensor_parallel, "a number of ranks >= 1")
    if devices is not None:
        raise ConfigError("tensor_parallel with --devices: give one or the other")
    if tail_skip is not None:
        raise ConfigError("tail_skip with tensor_parallel: a rank does not know which experts the others hold")
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.device_count() < (dev.index or 0) + tensor_parallel:
        raise ConfigError(f"tensor_parallel {tensor_parallel} from {dev}: one GPU per rank, GPUs {dev.index or 0}.."
                          f"{(dev.index or 0) + tensor_parallel - 1}, but {torch.cuda.device_count()} visible")
    return tensor_parallel


def kv_floor(path: Path, dtype: str | None, max_model_len: int | None) -> tuple[int, int]:
    """(bytes, tokens): the KV cache of one full-context sequence, the smallest KV budget the host plan leaves: of
    ``max_model_len`` tokens when given, else of the model's context capped at FLOOR_CONTEXT (the engine serves what
    the budget then holds). Sized by control/kvsizes.py from the config, in ``dtype`` when given."""
    from moe_offload.control.hf_config import load_config, text_config
    from moe_offload.control.spec import ModelSpec

    cfg = load_config(str(path))
    spec = ModelSpec.from_hf_config(cfg, name=path.name)
    model_len = int(text_config(cfg)[0].get("max_position_embeddings") or 2048)
    tokens = min(max_model_len, model_len) if max_model_len else min(model_len, FLOOR_CONTEXT)
    size = spec.kv_cache_bytes(tokens)
    if dtype:
        size = size * getattr(torch, dtype).itemsize // spec.dtype_bytes
    return size, tokens


def _host_plan(path: Path, dtype, expert_dtype, host_memory, kv_config: KVCacheConfig, device: str, cold_dtype=None,
               ranks: int = 1):
    """hostmem.plan_host for this checkpoint, weights first: its experts' and dense weights' bytes as the engine will
    hold them (with ``cold_dtype``, their lower-precision copy too), the KV budget bounded below by one full-context
    sequence (kv_floor). ``ranks`` > 1 (--tensor-parallel): the ranks share the process's memory limit (one container),
    so each plans its share of the experts (e mod ranks) in its share of the limit and of --host-memory."""
    from moe_offload import hostmem
    from moe_offload.engines.offload.loading.inspection import inspect_checkpoint
    from moe_offload.hostmem import plan_host, runtime_reserve

    require_count("host_memory", host_memory, "bytes (an integer >= 1)")
    _, experts, dense = inspect_checkpoint(path, dtype, expert_dtype)
    on_cpu = torch.device(device).type == "cpu"
    floor, tokens = kv_floor(path, dtype, kv_config.max_model_len) if on_cpu else (0, 0)
    expert_bytes = sum(i.expert_bytes * i.num_experts for i in experts)
    if cold_dtype is not None:  # the cold copy lives beside the experts in host memory
        try:
            cold = inspect_checkpoint(path, dtype, cold_dtype)[1]
        except ConfigError as e:  # e.g. MXFP4 experts: quantized already
            raise ConfigError(f"cold_dtype {cold_dtype}: {e}; it lowers float experts only") from None
        expert_bytes += sum(i.expert_bytes * i.num_experts for i in cold)
    limit = None
    if ranks > 1:
        whole = hostmem.host_memory_limit()
        limit = hostmem.HostMemory(whole.bytes // ranks, f"{whole.source} / {ranks} tensor-parallel ranks")
        expert_bytes = -(-expert_bytes // ranks)
        host_memory = host_memory // ranks if host_memory is not None else None
    plan = plan_host(expert_bytes, dense, host_memory=host_memory, limit=limit,
                     kv_asked=kv_config.kv_cache_memory, dense_on_host=on_cpu, kv_default=DEFAULT_KV_HOST if on_cpu else 0,
                     kv_floor=floor, reserve=runtime_reserve())
    if plan.host_cache is None and on_cpu and cold_dtype is None:  # (a cold copy is made from experts in memory)
        from moe_offload.engines.offload.loading.convert import existing_store

        if existing_store(str(path), dtype, expert_dtype) is not None:
            # every expert fits, and an expert store was written: host slots for all of them over it, read in the
            # background from the start (a forward waits only for what it routes to), one copy in memory
            plan = dataclasses.replace(plan, host_cache=sys.maxsize, reason=plan.reason + "; experts read from the "
                                       "expert store in the background (a forward waits only for what it routes to)")
        else:
            plan = dataclasses.replace(plan, reason=plan.reason + "; experts loaded up front")
    from moe_offload.log import get_logger

    get_logger("moe_offload.build").info("memory plan", **plan.split(),
                                          kv_floor_tokens=tokens)
    return plan


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
    host_memory: int | None = None,
    prefetch: bool = True,
    speculative=None,
    tail_skip: int | None = None,
    cold_dtype: str | None = None,
    devices=None,
    tensor_parallel: int | None = None,
    expert_parallel: tuple[int, int] | None = None,
    enable_prefix_caching: bool = False,
    kv_events: bool = False,
    kv_cache_dtype: str = "auto",
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
    projections and LM head; see loader.load_model). host_memory: bytes of host memory for the routed experts
    (default: what the process's memory limit leaves after the dense weights, the KV budget and a reserve); experts
    that do not fit live in an expert store file on disk, host memory caching them (hostmem.plan_host). prefetch:
    read the next layer's predicted experts ahead (disk tier only). speculative: a SpeculativeConfig, its JSON text
    or mapping (vLLM's --speculative-config), or None (off). tail_skip: APPROXIMATE, off by default: a token's
    routed experts ranked tail_skip or lower (0-based by router weight) are skipped when not resident (>= 1).
    cold_dtype: APPROXIMATE, off by default: "int8" | "int4", misses computed on the host from a copy in that format.
    devices: several accelerators ("cuda:0,cuda:1", "cpu,cpu" to exercise it on the CPU), each a tier of its own:
    a fraction's slots are split over them (loading/devices.py); the first runs the dense layers (``device`` then
    follows it). tensor_parallel: N > 1 ranks on torch.distributed (gloo on the CPU), each computing every layer's
    experts e with e mod N == its rank (ranks/parallel.py); this process is rank 0 and drives the others.
    expert_parallel: (rank, world) of one rank (set by ranks/parallel.py, not by users). enable_prefix_caching: keep full
    KV blocks for later requests with the same prefix (runtime/prefix_cache.py; vLLM's --enable-prefix-caching);
    kv_events: record the cache's BlockStored / BlockRemoved events for a publisher (serving/kv_events.py).
    kv_cache_dtype: APPROXIMATE unless "auto": "int8" | "fp8" (e4m3) KV rows with a scale per (token, head), about
    half the bytes of bf16 (runtime/kv.py; vLLM's --kv-cache-dtype).
    """
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(sorted(unknown))}; valid: {', '.join(BUILD_OPTIONS)}")
    check_policy(policy)
    if cache not in CACHES:
        raise ConfigError(f"cache: expected one of {', '.join(CACHES)}, got {cache!r}")
    kv_config = KVCacheConfig(block_size, kv_cache_memory, max_model_len, kv_cache_dtype)  # validated before loading
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens)
    speculative = SpeculativeConfig.parse(speculative)
    if cold_dtype is not None and cold_dtype not in ("int8", "int4"):
        raise ConfigError(f"cold_dtype: expected int8 or int4, got {cold_dtype!r}")
    require_count("tail_skip", tail_skip, "a rank >= 1 (a token's top expert is never skipped)")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    from moe_offload.engines.offload.loading.devices import parse, torch_device

    devices = parse(devices)
    if devices is not None and len(devices) > 1:
        device = str(torch_device(devices[0]))
    else:
        devices = None
    world = _check_parallel(tensor_parallel, device, devices, tail_skip)
    from moe_offload.engines.offload.loading.inspection import check_checkpoint
    from moe_offload.engines.offload.loading.loader import load_model

    if model_path is None:
        from moe_offload.demo import default_model

        model_path = default_model()
    path = check_checkpoint(str(Path(model_path).expanduser()))
    plan = _host_plan(path, dtype, expert_dtype, host_memory, kv_config, device, cold_dtype,
                      ranks=expert_parallel[1] if expert_parallel is not None else world)
    if world > 1 and expert_parallel is None:  # rank 0: start the others, each with this process's KV budget
        from moe_offload.engines.offload.ranks import parallel

        return parallel.launch(world, build_offload_engine, str(path), placement, dict(
            device=device, backend=backend, policy=policy, fraction=fraction, dtype=dtype,
            hybrid_threshold=hybrid_threshold, cache=cache, block_size=block_size,
            kv_cache_memory=plan.kv_bytes if plan.kv_bytes is not None else kv_cache_memory,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            expert_dtype=expert_dtype, dense_dtype=dense_dtype, host_memory=host_memory, prefetch=prefetch,
            speculative=speculative, cold_dtype=cold_dtype, enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype))
    if plan.kv_bytes is not None:
        kv_config = dataclasses.replace(kv_config, kv_cache_memory=plan.kv_bytes)
    if (plan.host_cache is not None and plan.host_cache < sys.maxsize and fraction is None and placement is None
            and torch.device(device).type == "cpu"):
        fraction = 0.0  # a CPU accelerator's pinned experts would hold host slots for good: the cache decides
    resolved = _placement(path, placement, fraction, policy, backend, dtype, devices)
    if expert_parallel is not None:
        from moe_offload.engines.offload.ranks.parallel import share

        resolved = share(resolved, *expert_parallel)
    offloaded = load_model(
        str(path), resolved, policy=policy, device=device, dtype=dtype, hybrid_threshold=hybrid_threshold,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype, host_cache=plan.host_cache, prefetch=prefetch,
        cold_dtype=cold_dtype, devices=devices, expert_parallel=expert_parallel,
        # every expert has a slot and no --host-memory budget was set: reads go through the page cache, as mmap's
        keep_page_cache=plan.host_cache == sys.maxsize and host_memory is None,
    )
    if torch.device(device).type == "cpu":
        from moe_offload.engines.offload.kernels import jit

        if not jit.load():
            from moe_offload.log import get_logger

            get_logger("moe_offload.build").warning(
                "CPU kernels off: decode runs transformers' modules, several times slower",
                reason=jit.info().get("error") or "disabled", fix="reinstall with a compiler (scripts/setup.sh)")
    if tail_skip is not None:
        offloaded.executor.tail_skip = tail_skip
    if expert_parallel is not None:
        from moe_offload.engines.offload.ranks.dense_split import shard_head

        offloaded.executor.ep = tuple(expert_parallel)
        shard_head(offloaded.model, *expert_parallel, rehome=torch.device(device).type == "cpu"
                   and plan.host_cache is None)  # as load_model rehomed the dense weights
    if speculative is not None and speculative.method == "mtp":  # the checkpoint's MTP layer (transformers skips it)
        from moe_offload.engines.offload.model import mtp

        offloaded.mtp = mtp.load(str(path), offloaded.model, offloaded.device)
    engine = OffloadEngine(offloaded, load_tokenizer(path), model_name=str(path), backend=backend, cache=cache,
                           kv_config=kv_config, scheduler=sched, speculative=speculative,
                           prefix_caching=enable_prefix_caching, kv_events=kv_events)
    engine.memory_plan = plan.split()
    return engine


__all__ = ["BUILD_OPTIONS", "build_offload_engine", "load_tokenizer"]
