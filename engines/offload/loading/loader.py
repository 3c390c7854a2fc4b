"""Load a local HF MoE checkpoint for the offload executor.

    checkpoint dir --validate (files, MoE layers, placement, memory)--> from_pretrained on the host
        (a quantized checkpoint, MXFP4 / FP8: checkpoint.py reads the experts as stored, transformers the rest)
      -> routed experts of each layer moved into the host store (pinned on CUDA), detached from the model,
         in their stored format or converted by --expert-dtype (int8 / fp8 quantized per expert, bf16)
      -> non-expert weights to the accelerator (model.to(device): the experts are no longer parameters)
      -> per MoE layer a SlotCache on the accelerator: the Placement's pinned experts + dynamic slots

Why experts never touch the accelerator first: transformers loads the checkpoint on
the host (its default device); we then take the expert tensors out of the module's
parameters before anything moves to the accelerator. On a CPU run those loaded
tensors *are* the host store (no second copy); on CUDA each layer is copied into
pinned memory and its unpinned original freed, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_offload.control import families, vocab
from moe_offload.engines.offload.experts import policies, tiering
from moe_offload.engines.offload.experts.executor import IMPLEMENTATION, RESIDENT, Executor, register
from moe_offload.engines.offload.experts.prefetch import Prefetcher
from moe_offload.engines.offload.experts.slots import SlotCache
from moe_offload.engines.offload.experts.store import cold_copy, take_from_module
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.loading import architecture, checkpoint, hugepages, quant
from moe_offload.engines.offload.loading import devices as devices_
from moe_offload.engines.offload.loading.inspection import (
    DTYPES,
    ExpertsInfo,
    check_checkpoint,
    compute_dtype_of,
    expert_target,
    inspect_checkpoint,
)
from moe_offload.errors import ConfigError, ModelError, PlacementError, require_count
from rm_core import Placement

EXPERT_DTYPES = tuple(vocab.EXPERT_DTYPES)  # --expert-dtype: quantize a float checkpoint's experts at load, or dequantize
COLD_DTYPES = ("int8", "int4")  # cold_dtype: the approximate copy misses are computed from


@dataclass
class OffloadedModel:
    """A transformers model whose routed experts run through the offload executor."""

    model: Any  # transformers PreTrainedModel, eval mode, non-expert weights on ``device``
    config: Any
    executor: Executor
    placement: Placement | None
    device: torch.device
    policy: str
    mtp: Any = None  # the checkpoint's MTP layer (model/mtp.py) when speculative method mtp asked for it


def load_model(
    path: str,
    placement: Placement | None,
    *,
    policy: str = "static",
    device: str = "cpu",
    dtype: str | None = None,
    hybrid_threshold: int | None = None,
    expert_dtype: str | None = None,
    dense_dtype: str | None = None,
    host_cache: int | None = None,
    prefetch: bool = True,
    cold_dtype: str | None = None,
    devices=None,
    expert_parallel: tuple[int, int] | None = None,
    keep_page_cache: bool = False,
) -> OffloadedModel:
    """Load checkpoint ``path`` with ``placement`` (None: every expert resident) under miss ``policy``.

    ``device``: "cpu" or "cuda[:N]". ``dtype``: "float32" | "bfloat16" | "float16" | None (checkpoint's): the
    compute dtype and the dtype of every non-expert weight.
    ``hybrid_threshold``: tokens per expert and step at which ``hybrid`` fetches instead of computing on the host.
    ``expert_dtype``: None keeps the experts as the checkpoint stores them (float, or MXFP4 / FP8 kept quantized);
    "int8" | "fp8" quantizes a float checkpoint's experts at load; "bf16" casts (float) or dequantizes (quantized).
    ``dense_dtype``: "int8" also holds the dense linears (quant.dense_linears: attention, shared experts, dense MLPs)
    and the LM head as int8 rows (quant.QuantLinear; bf16 compute on the cpu only); None or "bf16" keeps them in the
    compute dtype.
    ``host_cache``: bytes of host memory for routed experts when they are to live on disk (the expert store file,
    written once, convert.py): each MoE layer gets an equal share of host slots over its records, an LRU cache;
    None keeps every expert in host memory. ``prefetch``: read the next layer's predicted experts ahead (disk tier).
    ``cold_dtype``: APPROXIMATE, "int8" | "int4": a second copy of the float experts in that format, which misses
    computed on the host read (resident experts stay as stored); not with the disk tier.
    ``devices``: several accelerators ("cuda:0,cuda:1", "cpu,cpu"; loading/devices.py), each a tier holding its share
    of each layer's experts as the placement says; the first runs the rest of the model (``device`` is ignored).
    ``expert_parallel``: (rank, world): a float checkpoint's experts of other ranks are not read (ranks/parallel.py).
    ``keep_page_cache``: the store's reads leave the page cache be (diskstore.StoreFile ``keep_cache``): the engine's
    choice where every expert has a host slot and no host-memory budget was given.
    Raises ModelError (bad checkpoint, dense model), PlacementError (placement for another model, slots that do
    not fit), ConfigError (bad option) before any large allocation.
    """
    policies.check_policy(policy)
    require_count("hybrid_threshold", hybrid_threshold)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype: expected one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
    if cold_dtype is not None and (cold_dtype not in COLD_DTYPES or host_cache is not None):
        raise ConfigError(f"cold_dtype: expected one of {', '.join(COLD_DTYPES)} with every expert in host memory "
                          f"(not the disk tier), got {cold_dtype!r}" + (" with the disk tier" if host_cache else ""))
    if dense_dtype is not None and dense_dtype not in vocab.DENSE_DTYPES:
        raise ConfigError(f"dense_dtype: expected one of {', '.join(vocab.DENSE_DTYPES)}, got {dense_dtype!r}")
    names = devices_.parse(devices)
    if names is not None and len(names) > 1:
        dev = resolve_device(str(devices_.torch_device(names[0])))
        for n in names[1:]:
            resolve_device(str(devices_.torch_device(n)))
    else:
        names = None
        dev = resolve_device(device)
    root = check_checkpoint(path)

    config, experts, dense_bytes = inspect_checkpoint(root, dtype, expert_dtype)
    method = checkpoint.quant_method(config, str(root))
    gguf_file = getattr(config, "gguf_file", None)  # a GGUF file's view (gguf_load.view_dir)
    read_as, convert_to = expert_target(method, expert_dtype, gguf=gguf_file is not None)
    torch_dtype, compute_dtype = DTYPES[dtype] if dtype else None, compute_dtype_of(config, dtype)
    if dense_dtype == "int8" and (dev.type != "cpu" or compute_dtype not in (None, torch.bfloat16)):
        raise ConfigError(f"dense_dtype int8: needs bf16 compute on the cpu, got {compute_dtype} on {dev} "
                          "(give --dtype bfloat16, or leave the dense weights as they are)")
    if names is None:
        acc_tier, host_tier, layout = plan_layers(experts, placement, dev)
        parts = {layer: [lay] for layer, lay in layout.items()}
        names = [acc_tier]
    else:
        host_tier, parts = devices_.plan_devices(experts, placement, names)
        layout = {layer: ([e for p, _ in ps for e in p], sum(n for _, n in ps)) for layer, ps in parts.items()}
    for i, n in enumerate(names):
        d = devices_.torch_device(n) if len(names) > 1 else dev
        if d.type == "cuda":
            _check_cuda_fit(d, experts, {layer: ps[i] for layer, ps in parts.items()}, dense_bytes if i == 0 else 0)

    register()
    stored: dict = {}
    load_dtype = compute_dtype or torch.float32
    # a release held as ggml blocks (4-bit -> q4_0 / q4_z, NVFP4 -> nvfp4), or a GGUF file's blocks
    blocks = read_as == "stored" and (gguf_file is not None
                                      or checkpoint.STORED_FORMAT.get(method) in quant.ggml.BY_NAME)
    if dev.type != "cpu" and (blocks or convert_to in quant.ggml.BY_NAME):
        raise ConfigError(f"{dev}: ggml block experts (GGUF files, 4-bit and NVFP4 releases, --expert-dtype int4) "
                          "compute on the cpu only; give --expert-dtype bf16 to dequantize them at load")
    if gguf_file is not None:
        from moe_offload.engines.offload.loading import gguf_load

        if host_cache is not None:  # the disk tier: an expert store of the file's blocks, host slots over it
            from moe_offload.engines.offload.loading import gguf_store

            manifest = gguf_store.ensure_store(gguf_file, config, experts, load_dtype, dequantize=read_as == "float")
            pins = host_pins(placement)
            host_slots = tiering.host_slots(experts, manifest, layout, host_cache, _top_k(config),
                                            alias=dev.type == "cpu", host_pinned=pins)
        # the attention projections, shared experts, dense MLPs and LM head stay the file's blocks too, on the CPU
        # (--dense-dtype bf16: dequantized)
        model, stored = gguf_load.load(gguf_file, config, experts, load_dtype, dequantize=read_as == "float",
                                       dense_blocks=dev.type == "cpu" and dense_dtype != "bf16",
                                       read=host_cache is None)
    elif host_cache is not None:
        from moe_offload.engines.offload.loading.convert import ensure_store
        from moe_offload.engines.offload.loading.split import load_split

        manifest = ensure_store(root, config, experts, method, read_as, convert_to, load_dtype)
        pins = host_pins(placement)
        host_slots = tiering.host_slots(experts, manifest, layout, host_cache, _top_k(config),
                                        alias=dev.type == "cpu", host_pinned=pins)
        model, _ = load_split(root, config, experts, method, read_as, load_dtype, read_experts=False)
    else:
        from moe_offload.engines.offload.loading.split import load_split

        # experts read as stored (quantized) or by offset into the store (float): one copy, never through
        # from_pretrained's stacking; None: a layout direct.py does not cover
        loaded = None
        if method is not None:
            loaded = load_split(root, config, experts, method, read_as, load_dtype, only=expert_parallel)
        elif _direct(config):
            try:
                loaded = load_split(root, config, experts, method, read_as, load_dtype, only=expert_parallel)
            except (AttributeError, TypeError, ValueError, KeyError, ModelError) as e:  # a wrapper config or a
                # conversion it does not reproduce: the slower from_pretrained path loads it instead
                from moe_offload.log import get_logger

                get_logger("moe_offload.loader").debug("direct expert load off", reason=f"{type(e).__name__}: {e}")
        if loaded is not None:
            model, stored = loaded
        else:
            kwargs = {"experts_implementation": IMPLEMENTATION}
            if torch_dtype is not None:
                kwargs["dtype"] = torch_dtype
            # The text path only: an omni model's speech talker is not loaded, its thinker is what runs.
            kwargs.update(architecture.text_only(config))
            model = architecture.text_path(architecture.model_class(config).from_pretrained(root, **kwargs))
    model.eval()

    executor = Executor(dev, policy, (names[0], host_tier), hybrid_threshold)
    executor.device_tiers = tuple(names)
    modules = dict(model.named_modules())
    _, others = architecture.experts_modules(model)
    for name in others:  # experts the text path never routes to: resident, transformers' own forward
        object.__setattr__(modules[name], "_moe_offload", RESIDENT)
    stores = []
    if host_cache is not None:
        from moe_offload.engines.offload.loading.split import disk_stores

        pinned = {layer: sorted(set(p if dev.type == "cpu" else []) | set(pins.get(layer, [])))
                  for layer, (p, _) in layout.items()}
        cached, executor.disk, executor.io = disk_stores(modules, experts, manifest, host_slots, pinned,
                                                         pin=dev.type == "cuda", keep_cache=keep_page_cache)
        stores = [(info, modules[info.name], st) for info, st in zip(experts, cached)]
        executor.store_file = cached[0].file if cached else None  # its health: reads failing in a row
    else:
        for info in experts:
            module = modules[info.name]
            store = take_from_module(module, pin=dev.type == "cuda", stored=stored.pop(info.name, None),
                                     convert_to=convert_to)
            stores.append((info, module, store))
    if dev.type != "cpu":
        model.to(dev)  # non-expert weights only: the experts were detached above
    for info, module, store in stores:
        (pinned, dynamic), *more = parts[info.layer]
        cache = SlotCache(store, pinned, dynamic, dev, alias_pinned=dev.type == "cpu",
                          more=[(devices_.torch_device(n), p, d) for n, (p, d) in zip(names[1:], more)])
        state = executor.attach(module, info.layer, store, cache)
        if cold_dtype is not None:
            try:
                state.cold = cold_copy(store, module, vocab.EXPERT_DTYPES[cold_dtype])
            except ValueError as e:
                raise ConfigError(f"cold_dtype {cold_dtype}: {e}; it lowers float experts only") from None
    executor.cold_dtype = cold_dtype
    executor.finish_setup()
    family = families.family_of(getattr(model.config, "model_type", ""))
    for _, module, _ in stores:  # the experts' gate as the registry names it (dispatch.py fuses clamped_swiglu)
        dispatch.set_activation(module, family.activation if family is not None else "module")
    routers = _install_hooks(model, executor, [m for _, m, _ in stores], modules)
    if host_cache is not None and prefetch:
        executor.prefetcher = Prefetcher(routers)
    dispatch.prepare(model, stores[0][2].tensors[0].dtype if stores else None)  # bf16 CPU GEMV kernels (MOE_OFFLOAD_KERNELS=0: off)
    if dense_dtype == "int8":
        if dev.type != "cpu" or model.dtype != torch.bfloat16:
            raise ConfigError(f"dense_dtype int8: needs bf16 compute on the cpu, got {model.dtype} on {dev} "
                              "(give --dtype bfloat16, or leave the dense weights as they are)")
        quant.quantize_dense(model)
    # the dense weights (attention, LM head, ...) in huge pages as well, before any kernel path captures them (the
    # engine's decode step, built after this); not with the disk tier, which runs under a memory limit: there the
    # copies raised the peak RSS by ~0.2 GiB under a 1.8 GiB cgroup limit (bench_disk.py)
    if dev.type == "cpu" and host_cache is None:
        hugepages.rehome_module(model)
    if dev.type == "cpu":  # what still lies in the checkpoint's memory map (the disk tier's dense weights, small
        # tensors): copied out, so a checkpoint truncated under the running worker cannot SIGBUS it
        hugepages.copy_out_of_files(model, [f.resolve() for f in Path(root).glob("*.safetensors")])
    from moe_offload.log import get_logger

    get_logger("moe_offload.loader").info("experts_loaded", checkpoint=str(root), checkpoint_format=method or ("gguf" if gguf_file else "float"),
                                          huge_page_bytes=hugepages.huge_bytes(), **expert_summary(executor))
    return OffloadedModel(model, model.config, executor, placement, dev, policy)


def expert_summary(executor: Executor) -> dict:
    """{"expert_format", "expert_bytes" (one expert as stored), "host_store_bytes" (every expert once, as stored; with
    the disk tier: the host slots), "slot_bytes" (accelerator buffers the slots allocated; pinned CPU slots alias the
    store)}, and with the disk tier "disk_store_bytes", "host_slots_per_layer", "expert_store" (its directory)."""
    layers = executor.layers
    out = {
        "expert_format": layers[0].store.format if layers else "",
        "expert_bytes": layers[0].store.expert_bytes if layers else 0,
        "host_store_bytes": sum(s.store.nbytes for s in layers),
        "slot_bytes": sum(s.cache.buffer_bytes for s in layers),
    }
    if layers and hasattr(layers[0].store, "disk_bytes"):  # the disk tier: host slots over the expert store file
        out["disk_store_bytes"] = sum(s.store.disk_bytes for s in layers)
        out["host_slots_per_layer"] = layers[0].store.num_slots
        out["expert_store"] = str(layers[0].store.file.manifest.dir)
    return out


def resolve_device(device: str) -> torch.device:
    """torch.device of "cpu" or "cuda[:N]"; ConfigError for anything else, BackendUnavailable without the GPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda":
        from moe_offload.engines.offload.experts.cuda import check_device

        check_device(dev)
        dev = torch.device("cuda", dev.index or 0)
    return dev


def host_pins(placement: Placement | None) -> dict[int, list[int]]:
    """{layer: experts a three-tier placement pins in host memory} (plan --host-memory: the profile's hottest of
    those no accelerator holds; the rest are homed on its disk tier); {} for any other placement."""
    if placement is None:
        return {}
    disks = {t.name for t in placement.tiers if t.kind == "disk"}
    host = placement.host_tier or "host"
    # a layer with nothing on disk homes its other experts on host as "on no accelerator": nothing to pin there
    return {lp.layer: lp.pinned(host) for lp in placement.layers if any(h in disks for h in lp.home)}


def plan_layers(experts: list[ExpertsInfo], placement: Placement | None, dev: torch.device):
    """(accelerator tier, host tier, {layer: (pinned expert ids, dynamic slots)}); PlacementError if it does not fit the model."""
    device_name = f"{dev.type}:{dev.index or 0}"
    if placement is None:
        return device_name, "host", {i.layer: (list(range(i.num_experts)), 0) for i in experts}
    devices_.check_layers(experts, placement)
    below = {t.name for t in placement.tiers if t.accelerator is None}  # host memory and disk: no executor tier
    used = {t for lp in placement.layers for t in lp.slots if lp.slots[t] > 0 and t not in below}
    candidates = [t.name for t in placement.tiers if t.accelerator is not None]
    if len(used) > 1:
        raise PlacementError(f"placement uses slots on {len(used)} accelerator tiers {sorted(used)}, expected one per executor")
    acc = next(iter(used)) if used else (candidates[0] if candidates else device_name)
    host = placement.host_tier or "host"
    layout = {layer: parts[0] for layer, parts in devices_.layer_parts(experts, placement, [acc]).items()}
    return acc, host, layout


def _check_cuda_fit(dev: torch.device, experts: list[ExpertsInfo], layout, dense_bytes: int) -> None:
    """Slots + non-expert weights must fit the device's free memory (activations and KV cache come on top)."""
    from moe_offload.engines.offload.experts.cuda import free_bytes

    slots = sum(i.expert_bytes * (len(layout[i.layer][0]) + layout[i.layer][1]) for i in experts)
    free = free_bytes(dev)
    if slots + dense_bytes > free:
        raise PlacementError(
            f"expert slots ({slots / 2**30:.2f} GiB) + non-expert weights ({dense_bytes / 2**30:.2f} GiB) need "
            f"{(slots + dense_bytes) / 2**30:.2f} GiB on {dev}, but only {free / 2**30:.2f} GiB is free; "
            "lower the fraction or the slots"
        )


def _install_hooks(model, executor: Executor, experts_modules, modules) -> list:
    """Forward boundaries (capture records, total time) and router timing, via module hooks. Returns each experts
    module's router module (None where it has none named gate/router)."""
    import time

    stats_ref = executor
    state = {"t0": 0.0, "r0": 0.0}

    def pre(_m, _args):
        stats_ref.begin_forward()
        state["t0"] = time.perf_counter()

    def post(_m, _args, _out):
        stats_ref.end_forward(state["t0"])

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)

    def rpre(_m, _args):
        state["r0"] = time.perf_counter()

    def rpost(_m, _args, _out):
        if stats_ref.timing:
            stats_ref.stats.stage_s["router"] += time.perf_counter() - state["r0"]

    names = {id(m): n for n, m in modules.items()}
    found = []  # per experts module: its router (or None)
    for m in experts_modules:
        parent_name = names[id(m)].rsplit(".", 1)[0]
        for child in ("gate", "router"):
            router = modules.get(f"{parent_name}.{child}")
            if router is not None and router is not m:
                router.register_forward_pre_hook(rpre)
                router.register_forward_hook(rpost)
                break
        found.append(router if router is not None and router is not m else None)
    return found


def _direct(config) -> bool:
    """Float experts read by offset into the store (direct.py) rather than through from_pretrained: every family
    but the omni wrappers, whose text path loads from a sub-config."""
    return not architecture.text_only(config)


def _top_k(config) -> int:
    from moe_offload.control.hf_config import top_k_of

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    v = top_k_of(text.to_dict())
    return v if isinstance(v, int) and v > 0 else 1
