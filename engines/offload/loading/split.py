"""Loading without materializing the experts: transformers loads everything else, the experts are read here.

    meta model --find_sources--> which safetensors keys feed the routed experts
      -> the rest: a state dict of lazy slices (FP8 linears dequantized) + zero-stride placeholders for the experts'
         weights, loaded by from_pretrained (it neither reads nor allocates the experts)
      -> the experts: read as stored, one layer at a time (a quantized checkpoint kept quantized: ``load_split``), or
         not at all (the disk tier: ``disk_stores`` serves them from the expert store file through host slots)

Peak memory is the dense weights plus one layer (quantized) or one expert (the store's writer, convert.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from moe_offload.engines.offload.experts.diskstore import Manifest, StoreFile
from moe_offload.engines.offload.experts.executor import IMPLEMENTATION
from moe_offload.engines.offload.experts.hostcache import CachedLayerStore, DiskStats, IOPool
from moe_offload.engines.offload.experts.store import module_tensor_names
from moe_offload.engines.offload.loading import checkpoint
from moe_offload.engines.offload.loading.architecture import meta_model
from moe_offload.engines.offload.loading.direct import Offsets, read_float_layer
from moe_offload.errors import ModelError


def load_split(root: Path, config, experts: list, method: str | None, read_as: str, dtype: torch.dtype,
               read_experts: bool = True, only=None):
    """(model with placeholder experts, {experts module: (up, down, up_scale, down_scale)} when ``read_experts``), or
    None for a float checkpoint whose experts direct.read_float_layer does not cover (transposed). ``only``: expert
    parallel's (rank, world): a float checkpoint's experts of other ranks are not read (read_float_layer)."""
    meta = meta_model(config, dtype)
    modules = dict(meta.named_modules())
    if read_experts and method is None and any(modules[i.name].is_transposed for i in experts):
        return None
    with checkpoint.Files(root) as files:
        try:
            sources = checkpoint.find_sources(meta, experts, files.keys(), method)
        except ModelError:
            if method is None and read_experts:  # a conversion this reader does not reproduce: from_pretrained's turn
                return None
            raise
        stored = {}
        if read_experts and method is None:  # float: each expert tensor read into the store's rows, nothing twice
            from concurrent.futures import ThreadPoolExecutor

            offsets = Offsets(root)
            try:
                with ThreadPoolExecutor(8, thread_name_prefix="moe-offload-load") as pool:
                    for i in experts:
                        up, down = read_float_layer(offsets, sources[i.name], modules[i.name], i.num_experts, dtype,
                                                    pool, only)
                        stored[i.name] = (up, down, None, None)
            finally:
                offsets.close()
        elif read_experts:
            stored = {i.name: checkpoint.read_layer(files, sources[i.name], modules[i.name], i.num_experts, method,
                                                    read_as, torch.bfloat16) for i in experts}
        skip = set().union(*(s.keys(method) for s in sources.values()))
        state_dict = checkpoint.rest_state_dict(files, skip, method, dtype)
        state_dict.update(checkpoint.placeholders(meta, experts, dtype))
        cfg = copy.deepcopy(config)
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config  # no transformers quantizer: the experts are handled here, the rest is float
        # with a state dict transformers takes no path: name and generation config are set from the directory below
        model = type(meta).from_pretrained(None, config=cfg, state_dict=state_dict, dtype=dtype,
                                           experts_implementation=IMPLEMENTATION)
    model.config.name_or_path = str(root)
    if (Path(root) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(root)
    return model, stored


def disk_stores(modules: dict, experts: list, manifest: Manifest, slots: dict[int, int], pinned: dict[int, list[int]],
                threads: int = 8, pin: bool = False, keep_cache: bool = False
                ) -> tuple[list[CachedLayerStore], DiskStats, IOPool]:
    """Per experts module a CachedLayerStore of ``slots[layer]`` host slots (``pinned[layer]`` kept) over its records;
    the modules lose their placeholder weights and keep their biases, as take_from_module leaves them.
    ``keep_cache``: every expert has a slot; reads leave the page cache be (StoreFile)."""
    file = StoreFile(manifest, keep_cache=keep_cache)
    stats, io = DiskStats(), IOPool(threads)
    rows = set(manifest.meta.get("rows_layers", ()))
    out = []
    for info in experts:
        module = modules[info.name]
        entry = manifest.layers.get(info.name)
        if entry is None or entry.num_experts != info.num_experts:
            raise ModelError(f"{manifest.dir}: the expert store has no {info.name} of {info.num_experts} experts; "
                             "delete it to have it written again")
        names = module_tensor_names(module)
        params = [module._parameters.pop(n).detach() if n is not None else None for n in names]
        compute = params[0].dtype
        store = CachedLayerStore(file, entry, slots[info.layer], pinned.get(info.layer, []), (params[2], params[3]),
                                 compute, io, stats, pin=pin)
        if info.name in rows:
            module.is_transposed = False
        for n, t in zip(names, (store.tensors[0], store.tensors[1], params[2], params[3])):
            if n is not None:
                object.__setattr__(module, n, t)
        out.append(store)
    return out, stats, io
