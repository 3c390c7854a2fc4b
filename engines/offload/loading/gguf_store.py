r"""A GGUF file's expert store (the disk tier): its expert blocks read in place where the engine computes from them
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
    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.engines.offload.experts.store import finalize_expert
    from moe_offload.engines.offload.loading.architecture import meta_model
    from moe_offload.engines.offload.loading.direct import write_store

    default, target = store_dir(path, dtype, dequantize)
    where, origin = Path(out) if out is not None else default, str(gguf_meta.files_of(path)[0].resolve())
    man = diskstore.read_manifest(where)
    if man is not None and man.meta.get("checkpoint") == origin:
        return man  # else none, or a store of another file under this name (a directory copied): written now
    info = gguf_meta.read(path)
    tensors = Tensors(info)
    modules = dict(meta_model(config, dtype).named_modules())

    def records(i):
        for e in range(i.num_experts):
            up, down, _, _ = read_experts(tensors, i, modules[i.name], dtype, dequantize, expert=e)
            yield finalize_expert(modules[i.name], dtype, up[0], down[0], was_float=False)

    return write_store(where, target, origin, experts, lambda: _in_place(tensors, experts, modules, dtype, dequantize),
                       records)


def _in_place(tensors: Tensors, experts: list, modules: dict, dtype: torch.dtype, dequantize: bool):
    """(files, per layer (entries, record bytes, per expert extents)) when each expert's record is its gate, up and down
    slices of the file as they are (ggml blocks kept as stored, or float experts already in ``dtype``), else why not.
    Expert 0 and the last expert of each layer are read through the extents and compared with read_experts'."""
    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.engines.offload.experts.store import finalize_expert
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
                return finalize_expert(module, dtype, up[0], down[0], was_float=False)[0]

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
        return list(tensors.info.files), out
    finally:
        for fd in fds:
            os.close(fd)
