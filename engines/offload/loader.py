"""Load a local HF MoE checkpoint for the offload executor.

    checkpoint dir --validate (files, MoE layers, placement, memory)--> from_pretrained on the host
      -> routed experts of each layer moved into the host store (pinned on CUDA), detached from the model
      -> non-expert weights to the accelerator (model.to(device): the experts are no longer parameters)
      -> per MoE layer a SlotCache on the accelerator: the Placement's pinned experts + dynamic slots

Why experts never touch the accelerator first: transformers loads the checkpoint on
the host (its default device); we then take the expert tensors out of the module's
parameters before anything moves to the accelerator. On a CPU run those loaded
tensors *are* the host store (no second copy); on CUDA each layer is copied into
pinned memory and its unpinned original freed, one layer at a time.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_offload.engines.offload import architecture, kernels, policies
from moe_offload.engines.offload.executor import IMPLEMENTATION, RESIDENT, Executor, register
from moe_offload.engines.offload.slots import SlotCache
from moe_offload.engines.offload.store import module_tensor_names, take_from_module
from moe_offload.errors import ConfigError, ModelError, PlacementError
from rm_core import Placement

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class OffloadedModel:
    """A transformers model whose routed experts run through the offload executor."""

    model: Any  # transformers PreTrainedModel, eval mode, non-expert weights on ``device``
    config: Any
    executor: Executor
    placement: Placement | None
    device: torch.device
    policy: str


@dataclass(frozen=True)
class ExpertsInfo:
    """An experts module found on the meta model: where it is and what one of its experts weighs."""

    name: str
    layer: int
    num_experts: int
    expert_bytes: int


def load_model(
    path: str,
    placement: Placement | None,
    *,
    policy: str = "static",
    device: str = "cpu",
    dtype: str | None = None,
    hybrid_threshold: int | None = None,
) -> OffloadedModel:
    """Load checkpoint ``path`` with ``placement`` (None: every expert resident) under miss ``policy``.

    ``device``: "cpu" or "cuda[:N]". ``dtype``: "float32" | "bfloat16" | "float16" | None (checkpoint's).
    ``hybrid_threshold``: tokens per expert and step at which ``hybrid`` fetches instead of computing on the host.
    Raises ModelError (bad checkpoint, dense model), PlacementError (placement for another model, slots that do
    not fit), ConfigError (bad option) before any large allocation.
    """
    policies.check_policy(policy)
    if hybrid_threshold is not None and (isinstance(hybrid_threshold, bool) or not isinstance(hybrid_threshold, int) or hybrid_threshold < 1):
        raise ConfigError(f"hybrid_threshold: expected an integer >= 1, got {hybrid_threshold!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    dev = resolve_device(device)
    root = check_checkpoint(path)

    config, experts, dense_bytes = inspect_checkpoint(root, dtype)
    torch_dtype = DTYPES[dtype] if dtype else None
    acc_tier, host_tier, layout = plan_layers(experts, placement, dev)
    if dev.type == "cuda":
        _check_cuda_fit(dev, experts, layout, dense_bytes)

    register()
    kwargs = {"experts_implementation": IMPLEMENTATION}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    # The text path only: an omni model's speech talker is not loaded, its thinker is what runs.
    kwargs.update(architecture.text_only(config))
    model = architecture.text_path(architecture.model_class(config).from_pretrained(root, **kwargs))
    model.eval()

    executor = Executor(dev, policy, (acc_tier, host_tier), hybrid_threshold)
    modules = dict(model.named_modules())
    _, others = architecture.experts_modules(model)
    for name in others:  # experts the text path never routes to: resident, transformers' own forward
        object.__setattr__(modules[name], "_moe_offload", RESIDENT)
    stores = []
    for info in experts:
        module = modules[info.name]
        stores.append((info, module, take_from_module(module, pin=dev.type == "cuda")))
    if dev.type != "cpu":
        model.to(dev)  # non-expert weights only: the experts were detached above
    for info, module, store in stores:
        pinned, dynamic = layout[info.layer]
        cache = SlotCache(store, pinned, dynamic, dev, alias_pinned=dev.type == "cpu")
        executor.attach(module, info.layer, store, cache)
    executor.finish_setup()
    _install_hooks(model, executor, [m for _, m, _ in stores], modules)
    kernels.prepare(model, stores[0][2].tensors[0].dtype if stores else None)  # bf16 CPU GEMV kernels (MOE_OFFLOAD_KERNELS=0: off)
    return OffloadedModel(model, model.config, executor, placement, dev, policy)


def resolve_device(device: str) -> torch.device:
    """torch.device of "cpu" or "cuda[:N]"; ConfigError for anything else, BackendUnavailable without the GPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda":
        from moe_offload.engines.offload.cuda import check_device

        check_device(dev)
        dev = torch.device("cuda", dev.index or 0)
    return dev


def check_checkpoint(path: str) -> Path:
    """A directory with config.json and every safetensors shard its index names; else ModelError."""
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
    elif not any(root.glob("*.safetensors")):
        raise ModelError(f"{root}: expected model.safetensors or a sharded index, found no safetensors files")
    return root


_INSPECTED: dict[tuple, tuple] = {}  # (path, config mtime, dtype) -> inspect_checkpoint's answer; the last few


def inspect_checkpoint(root: str | Path, dtype: str | None = None) -> tuple[Any, list[ExpertsInfo], int]:
    """(transformers config, experts modules, non-expert bytes) of checkpoint ``root`` loaded in ``dtype``
    (None: the checkpoint's). ModelError for a config transformers cannot read or a model without experts.
    Remembered per path, config.json mtime and dtype: building an engine asks for its placement and again for
    loading, and the meta model need not be built twice."""
    root = Path(root)
    key = (str(root), (root / "config.json").stat().st_mtime_ns, dtype)
    if key in _INSPECTED:
        return _INSPECTED[key]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(root)
    except (ValueError, OSError, KeyError) as e:
        raise ModelError(f"{root}: config.json cannot be read by transformers: {e}") from None
    cfg_dtype = getattr(config, "dtype", None)  # what from_pretrained will load when dtype is None
    torch_dtype = DTYPES[dtype] if dtype else (cfg_dtype if isinstance(cfg_dtype, torch.dtype) else None)
    experts, dense_bytes = inspect_model(config, torch_dtype)
    if not experts:
        raise ModelError(f"{root}: dense model (model_type {config.model_type!r}): no routed experts modules to offload")
    while len(_INSPECTED) >= 4:
        _INSPECTED.pop(next(iter(_INSPECTED)))
    _INSPECTED[key] = (config, experts, dense_bytes)
    return config, experts, dense_bytes


def find_experts(config, dtype: torch.dtype | None = None) -> list[ExpertsInfo]:
    """Experts modules of the model ``config`` describes, found on the meta device (no memory)."""
    return inspect_model(config, dtype)[0]


def inspect_model(config, dtype: torch.dtype | None = None) -> tuple[list[ExpertsInfo], int]:
    """(experts modules the executor serves, bytes of all other parameters of the text path) of the model
    ``config`` describes, built on the meta device with the class ``load_model`` loads it with."""
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
    for e in architecture.experts_modules(model)[0]:
        tensors = [getattr(e.module, n) for n in module_tensor_names(e.module) if n is not None]
        nbytes = sum(t[0].numel() * t.element_size() for t in tensors)
        found.append(ExpertsInfo(e.name, e.layer, int(tensors[0].shape[0]), nbytes))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    routed = sum(i.expert_bytes * i.num_experts for i in found)
    return found, total - routed


is_experts_module = architecture.is_experts_module


def plan_layers(experts: list[ExpertsInfo], placement: Placement | None, dev: torch.device):
    """(accelerator tier, host tier, {layer: (pinned expert ids, dynamic slots)}); PlacementError if it does not fit the model."""
    device_name = f"{dev.type}:{dev.index or 0}"
    if placement is None:
        return device_name, "host", {i.layer: (list(range(i.num_experts)), 0) for i in experts}
    layers = {i.layer: i for i in experts}
    placed = {lp.layer for lp in placement.layers}
    if placed != set(layers):
        raise PlacementError(
            f"placement for model {placement.model!r} covers MoE layers {sorted(placed)}, "
            f"expected this model's MoE layers {sorted(layers)}"
        )
    used = {t for lp in placement.layers for t in lp.slots if lp.slots[t] > 0}
    candidates = [t.name for t in placement.tiers if t.accelerator is not None]
    if len(used) > 1:
        raise PlacementError(f"placement uses slots on {len(used)} accelerator tiers {sorted(used)}, expected one per executor")
    acc = next(iter(used)) if used else (candidates[0] if candidates else device_name)
    host = placement.host_tier or "host"
    layout = {}
    for lp in placement.layers:
        info = layers[lp.layer]
        if lp.num_experts != info.num_experts:
            raise PlacementError(
                f"placement layer {lp.layer}: {lp.num_experts} experts, expected this model's {info.num_experts}"
            )
        pinned = lp.pinned(acc)
        slots = lp.slots.get(acc, len(pinned))
        layout[lp.layer] = (pinned, slots - len(pinned))
    return acc, host, layout


def _check_cuda_fit(dev: torch.device, experts: list[ExpertsInfo], layout, dense_bytes: int) -> None:
    """Slots + non-expert weights must fit the device's free memory (activations and KV cache come on top)."""
    from moe_offload.engines.offload.cuda import free_bytes

    slots = sum(i.expert_bytes * (len(layout[i.layer][0]) + layout[i.layer][1]) for i in experts)
    free = free_bytes(dev)
    if slots + dense_bytes > free:
        raise PlacementError(
            f"expert slots ({slots / 2**30:.2f} GiB) + non-expert weights ({dense_bytes / 2**30:.2f} GiB) need "
            f"{(slots + dense_bytes) / 2**30:.2f} GiB on {dev}, but only {free / 2**30:.2f} GiB is free; "
            "lower the fraction or the slots"
        )


def _install_hooks(model, executor: Executor, experts_modules, modules) -> None:
    """Forward boundaries (capture records, total time) and router timing, via module hooks."""
    import time

    stats_ref = executor
    state = {"t0": 0.0, "r0": 0.0}

    def pre(_m, _args):
        stats_ref.begin_forward()
        state["t0"] = time.perf_counter()

    def post(_m, _args, _out):
        st = stats_ref.stats
        st.forwards += 1
        st.forward_s += time.perf_counter() - state["t0"]

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)

    def rpre(_m, _args):
        state["r0"] = time.perf_counter()

    def rpost(_m, _args, _out):
        if stats_ref.timing:
            stats_ref.stats.stage_s["router"] += time.perf_counter() - state["r0"]

    names = {id(m): n for n, m in modules.items()}
    for m in experts_modules:
        parent_name = names[id(m)].rsplit(".", 1)[0]
        for child in ("gate", "router"):
            router = modules.get(f"{parent_name}.{child}")
            if router is not None and router is not m:
                router.register_forward_pre_hook(rpre)
                router.register_forward_hook(rpost)
                break
