"""A GGUF file's expert store (the disk tier): its expert blocks read in place where the engine computes from them
as the file lays them out (a manifest of each expert's gate, up and down slices), else a copy written once.

    ensure_store(file) --_in_place (expert 0 and the last compared with read_experts' bytes)--> manifest of extents
                       \--otherwise (gpt-oss's interleaved gate|up, --expert-dtype bf16)--> experts.bin records
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_offload.control import gguf_meta
from moe_offload.engines.offload.loading.gguf_load import Tensors, read_experts, store_dir


def ensure_store(path, config, experts: list, dtype: torch.dtype, dequantize: bool = False, out: Path | None = None):
    """The expert store (diskstore.Manifest) of GGUF ``path`` as the in-memory engine would hold its experts (ggml
    blocks, or ``dequantize``d to ``dtype``), written now when there is none. Each record is one expert's gate|up and
    down read from the file's map (finalized as take_from_module finalizes a layer), so the disk tier computes from
    the same bytes in the same types."""
    import time

    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.engines.offload.experts.store import LayerStore, finalize
    from moe_offload.engines.offload.loading.architecture import meta_model
    from moe_offload.log import get_logger

    default, target = store_dir(path, dtype, dequantize)
    where = Path(out) if out is not None else default
    man = diskstore.read_manifest(where)
    if man is not None and man.meta.get("checkpoint") == str(gguf_meta.files_of(path)[0].resolve()):
        return man  # else none, or a store of another file under this name (a directory copied): written now
    info = gguf_meta.read(path)
    log = get_logger("moe_offload.gguf")
    t0 = time.perf_counter()
    log.info("writing the expert store (once per file and format)", gguf=str(info.files[0]), store=str(where))
    tensors = Tensors(info)
    modules = dict(meta_model(config, dtype).named_modules())
    place = _in_place(tensors, experts, modules, dtype, dequantize)
    if not isinstance(place, str):  # the file's expert tensors are the records: a manifest of their extents, no copy
        man = diskstore.write_in_place(where, target, {"checkpoint": str(info.files[0].resolve())}, list(info.files),
                                       experts, place)
        log.info("expert store in place: the file's expert tensors are read where they are", store=str(where),
                 seconds=round(time.perf_counter() - t0, 1))
        return man

    def records(i):
        module = modules[i.name]
        for e in range(i.num_experts):
            up, down, _, _ = read_experts(tensors, i, module, dtype, dequantize, expert=e)
            one, rows = finalize(LayerStore((up, down, None, None, None, None), dtype), module, False, False, None)
            yield (one.tensors[0][0], one.tensors[1][0], None, None), rows

    log.info("expert store copied: the file's layout is not the one the engine computes from", why=place,
             store=str(where))
    man = diskstore.write_copy(where, target, {"checkpoint": str(info.files[0].resolve())}, experts,
                               (records(i) for i in experts))
    log.info("expert store written", store=str(where), seconds=round(time.perf_counter() - t0, 1))
    return man


def _in_place(tensors: Tensors, experts: list, modules: dict, dtype: torch.dtype, dequantize: bool):
    """Per layer (entries, record bytes, per expert extents) when each expert's record is its gate, up and down
    slices of the file as they are (ggml blocks kept as stored, or float experts already in ``dtype``), else why not.
    Expert 0 and the last expert of each layer are read through the extents and compared with read_experts'."""
    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.engines.offload.experts.store import LayerStore, finalize
    from moe_offload.engines.offload.loading.direct import same_bytes

    if dequantize:
        return "the experts are dequantized at load (--expert-dtype bf16)"
    out = []
    fds = [os.open(str(f), os.O_RDONLY) for f in tensors.info.files]
    try:
        for i in experts:
            module = modules[i.name]
            if getattr(module, "is_transposed", False):
                return f"{i.name}: gate and up rows interleaved (gpt-oss), a layout the file does not have"
            names = [f"blk.{i.layer}.{t}.weight" for t in gguf_meta.EXPERT_TENSORS]

            def record(e):
                up, down, _, _ = read_experts(tensors, i, module, dtype, False, expert=e)
                one, _ = finalize(LayerStore((up, down, None, None, None, None), dtype), module, False, False, None)
                return one.tensors[0][0], one.tensors[1][0], None, None

            first = record(0)
            entries, rb = diskstore.layout(first)
            extents = []
            for e in range(i.num_experts):
                (fg, og, ng), (fu, ou, nu), (fd, od, nd) = (tensors.extent(n, e) for n in names)
                extents.append([(fg, og, ng, 0), (fu, ou, nu, ng), (fd, od, nd, entries[1].offset)])
            last = i.num_experts - 1
            if not (same_bytes(fds, extents[0], entries, rb, first)
                    and same_bytes(fds, extents[last], entries, rb, record(last))):
                return f"{i.name}: an expert read in place differs from its copy"  # read both ways
            out.append((entries, rb, extents))
        return out
    finally:
        for fd in fds:
            os.close(fd)
