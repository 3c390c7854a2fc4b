"""Writing a checkpoint's routed experts into an expert store file (experts/diskstore.py), one expert at a time.

    checkpoint dir --find_sources (the keys of each experts module, as transformers maps them)-->
      per layer, per expert: its tensors read from the safetensors (one slice per projection), cast to the compute
      dtype as from_pretrained would, then finalized exactly as the in-memory store is (store.finalize: --expert-dtype
      quantization, gpt-oss rows) --> one record in experts.bin; the manifest last

Memory: one expert (one layer for an FP8/MXFP4 checkpoint, read as checkpoint.read_layer reads it). The records
hold the bytes the in-memory store would hold, so the disk tier computes the same numbers as the all-in-DRAM engine.

In place first: where the checkpoint's files already hold every expert's tensors as the store would (the compute
dtype, no --expert-dtype conversion, no quantized layout, not transposed), the store is a manifest of their extents
(diskstore, "in place") and no byte is copied; expert 0 and the last expert are read both ways and must be equal
bytes, else the copy is written. A copy checks the disk's free space first and refuses a shortfall in one line.
Where: $MOE_OFFLOAD_STORE_DIR or ~/.cache/moe-offload/stores, one directory per checkpoint (path, config.json and
safetensors sizes and mtimes) and stored format; `moe-offload convert` writes one ahead of the first run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from moe_offload.engines.offload.experts import diskstore
from moe_offload.engines.offload.experts.store import finalize_expert
from moe_offload.engines.offload.loading import checkpoint, direct
from moe_offload.engines.offload.loading.architecture import meta_model
from moe_offload.hostmem import store_root
from moe_offload.log import get_logger

log = get_logger("moe_offload.convert")


def store_dir(root: Path, target: str) -> Path:
    """Where the store of checkpoint ``root`` in stored format ``target`` lives (keyed by the files it came from)."""
    root = Path(root).resolve()
    h = hashlib.sha256(f"{root}|{target}|{diskstore.VERSION}".encode())
    for f in sorted([root / "config.json", *root.glob("*.safetensors")]):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return store_root() / f"{root.name}-{target}-{h.hexdigest()[:16]}"


def stored_format(method: str | None, read_as: str, convert_to: str | None, dtype: torch.dtype) -> str:
    """The name of the format the engine holds experts in: ``--expert-dtype``'s conversion, else the checkpoint's
    quantized format kept as stored, else the compute dtype's name."""
    stored = checkpoint.STORED_FORMAT.get(method, method)  # a 4-bit release is held as q4_0 blocks
    return convert_to or (stored if method and read_as == "stored" else str(dtype).removeprefix("torch."))


def ensure_store(root: Path, config, experts: list, method: str | None, read_as: str, convert_to: str | None,
                 dtype: torch.dtype, out: Path | None = None) -> diskstore.Manifest:
    """The expert store of ``root`` as the engine would hold its experts (see loader.load_model's arguments), written
    now when there is none. ``out``: the directory (default: store_dir)."""
    target = stored_format(method, read_as, convert_to, dtype)
    where, origin = Path(out) if out is not None else store_dir(root, target), str(Path(root).resolve())
    man = diskstore.read_manifest(where)
    if man is not None and man.meta.get("checkpoint") == origin:
        return man  # else none, or a store of another checkpoint under this name (a directory copied): written now
    modules = dict(meta_model(config, dtype).named_modules())
    with checkpoint.Files(root) as files:
        sources = checkpoint.find_sources(modules[""], experts, files.keys(), method)

        def in_place():
            if convert_to is not None:
                return f"--expert-dtype makes {convert_to} experts"
            if method is not None:
                return f"a {method} release's experts are {'dequantized' if read_as == 'float' else 'repacked'} at load"
            return _in_place(root, files, sources, modules, experts, dtype)

        def records(info):
            module = modules[info.name]
            for up, down, us, ds in _experts(files, sources[info.name], module, info.num_experts, method, read_as,
                                             dtype):
                yield finalize_expert(module, dtype, up, down, us, ds, method is None or read_as == "float", convert_to)

        return direct.write_store(where, target, origin, experts, in_place, records)


def _in_place(root: Path, files, sources: dict, modules: dict, experts: list, dtype: torch.dtype):
    """(files, per layer (entries, record bytes, per expert extents)) when every expert's record is the bytes of
    extents of the checkpoint's safetensors as they are (gate and up parts side by side), else why not (a str). Expert 0 and
    the last expert of each layer are read through the extents and compared with what the copy would hold."""
    from moe_offload.engines.offload.loading.direct import Offsets, same_bytes

    offsets = Offsets(root)
    try:
        paths = sorted({w[0] for w in offsets.where.values()})
        index = {p: i for i, p in enumerate(paths)}
        out = []
        for info in experts:
            module, src = modules[info.name], sources[info.name]
            if module.is_transposed:
                return f"{info.name}: transposed experts are kept as [out, in] rows"  # store.finalize
            first = _record(files, src, module, 0, dtype)
            entries, rb = diskstore.layout(first)
            extents = []
            for e in range(info.num_experts):
                ex = []
                for proj, pos in ((src.up, entries[0].offset), (src.down, entries[1].offset)):
                    keys = [proj.fused] if proj.fused is not None else [proj.parts[e][i] for i in range(proj.nparts)]
                    for key in keys:  # gate and up parts side by side make the fused gate|up
                        if key not in offsets.where:
                            return f"{key}: not a plain safetensors tensor"
                        path, off, dt, shape = offsets.where[key]
                        if dt != dtype:
                            return f"{key} is {str(dt).removeprefix('torch.')}, the engine computes in " \
                                   f"{str(dtype).removeprefix('torch.')}"  # cast at load: a copy
                        n = dt.itemsize
                        for d in shape:
                            n *= d
                        if proj.fused is not None:
                            if shape[0] != info.num_experts:
                                return f"{key}: {shape[0]} stacked experts, expected {info.num_experts}"
                            n //= info.num_experts
                            off += e * n
                        ex.append((index[path], off, n, pos))
                        pos += n
                extents.append(ex)
            fds = [offsets.fd(p) for p in paths]
            last = info.num_experts - 1
            if not (same_bytes(fds, extents[0], entries, rb, first)
                    and same_bytes(fds, extents[last], entries, rb, _record(files, src, module, last, dtype))):
                return f"{info.name}: an expert read in place differs from its copy"  # read both ways
            out.append((entries, rb, extents))
        return [Path(p) for p in paths], out
    finally:
        offsets.drop()
        offsets.close()


def _record(files, src, module, e: int, dtype: torch.dtype) -> tuple:
    """Expert ``e``'s record tensors (up, down, None, None) as the copy would hold them (float checkpoints)."""
    return finalize_expert(module, dtype, _float(files, src.up, e).to(dtype), _float(files, src.down, e).to(dtype))[0]


def _experts(files, src, module, num_experts: int, method: str | None, read_as: str, dtype: torch.dtype):
    """(up, down, up_scale | None, down_scale | None) of each expert in turn, in the module's own layout."""
    if method is not None:  # FP8 / MXFP4: checkpoint.read_layer's one-layer read, as the in-memory loader does
        up, down, us, ds = checkpoint.read_layer(files, src, module, num_experts, method, read_as, torch.bfloat16)
        for e in range(num_experts):
            yield up[e], down[e], us[e] if us is not None else None, ds[e] if ds is not None else None
        return
    for e in range(num_experts):
        yield _float(files, src.up, e).to(dtype), _float(files, src.down, e).to(dtype), None, None


def _float(files, proj: checkpoint.Projection, e: int) -> torch.Tensor:
    if proj.fused is not None:
        return files.slice(proj.fused)[e]
    return torch.cat([files.tensor(proj.parts[e][i]) for i in range(proj.nparts)], dim=0)



def _target(path: str, dtype: str | None, expert_dtype: str | None):
    """(root, config, experts, quant method, read_as, convert_to, compute dtype, stored format name) of a checkpoint
    loaded with ``dtype`` / ``expert_dtype``, as load_model resolves them."""
    from moe_offload.engines.offload.loading.inspection import (
        check_checkpoint,
        compute_dtype_of,
        expert_target,
        inspect_checkpoint,
    )

    root = check_checkpoint(path)
    config, experts, _ = inspect_checkpoint(root, dtype, expert_dtype)
    method = checkpoint.quant_method(config, str(root))
    read_as, convert_to = expert_target(method, expert_dtype, gguf=getattr(config, "gguf_file", None) is not None)
    compute = compute_dtype_of(config, dtype) or torch.float32
    return root, config, experts, method, read_as, convert_to, compute, stored_format(method, read_as, convert_to, compute)


def _where(root: Path, config, read_as: str, compute: torch.dtype, target: str) -> Path:
    """Where the expert store of a checkpoint resolved by _target lives (a GGUF file's: keyed by the file)."""
    if getattr(config, "gguf_file", None) is not None:
        from moe_offload.engines.offload.loading import gguf_load

        return gguf_load.store_dir(config.gguf_file, compute, read_as == "float")[0]
    return store_dir(root, target)


def existing_store(path: str, dtype: str | None = None, expert_dtype: str | None = None) -> diskstore.Manifest | None:
    """The expert store of checkpoint ``path`` in the format the engine would hold, when one was written."""
    root, config, _, _, read_as, _, compute, target = _target(path, dtype, expert_dtype)
    return diskstore.read_manifest(_where(root, config, read_as, compute, target))


def convert_checkpoint(path: str, dtype: str | None = None, expert_dtype: str | None = None) -> tuple[diskstore.Manifest, bool]:
    """(the expert store of checkpoint ``path`` as the engine would load it with ``dtype`` / ``expert_dtype``, whether
    it was written now). What `moe-offload convert` runs; the engine finds the store where this puts it."""
    root, config, experts, method, read_as, convert_to, compute, target = _target(path, dtype, expert_dtype)
    where = _where(root, config, read_as, compute, target)
    found = diskstore.read_manifest(where)
    if found is not None and not diskstore.verify(found):  # the size is right, the bytes are not: written again
        log.warning("expert store does not match its checksum: writing it again", store=str(where))
        diskstore.discard(where)
        found = None
    existed = found is not None
    if getattr(config, "gguf_file", None) is not None:  # the file's blocks (or --expert-dtype bf16's floats)
        from moe_offload.engines.offload.loading import gguf_store

        return gguf_store.ensure_store(config.gguf_file, config, experts, compute, read_as == "float"), not existed
    return ensure_store(root, config, experts, method, read_as, convert_to, compute), not existed
