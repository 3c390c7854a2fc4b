"""A GGUF file as a transformers model whose routed experts stay in the file's quant types.

    FILE.gguf --control/gguf_meta.read--> config dict, tensor list
      --view_dir--> a directory beside nothing: config.json + the tokenizer transformers builds from the GGUF
                    vocabulary (what --model DIR code paths read: tokenizer, chat template, spec)
      --load--> meta model; every non-expert tensor dequantized (gguf package) to the compute dtype under its
                transformers name, llama.cpp's converter undone where it changed a layout (llama's q/k row
                permutation, DeepSeek's kv_b split into k_b / v_b, gpt-oss's de-interleaved gate/up);
                the experts: ffn_gate_exps | ffn_up_exps rows concatenated (gpt-oss: interleaved) and ffn_down_exps,
                as ggml blocks (ggml.py), read from the file's memory map once
      --ensure_store (the disk tier, when host memory is smaller than the experts)--> an expert store file
                (experts/diskstore.py) whose records are each expert's gate|up and down blocks, the file's bytes
                in the file's types, written once, one expert in memory at a time

A truncated or corrupt file fails here, naming the tensor, never mid-generation: every tensor's bytes are checked
against the file's size before anything is read (gguf_meta.open_reader).
Legend: E experts, I expert intermediate, H hidden, nb blocks per row, S bytes per block.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from moe_offload import settings
from moe_offload.control import gguf_meta
from moe_offload.engines.offload.loading import ggml
from moe_offload.errors import ModelError


def view_dir(path: str | os.PathLike) -> Path:
    """A directory with the config.json and tokenizer of GGUF ``path``, written once per file version."""
    info = gguf_meta.read(path)
    # the files' identity and the config this version maps them to: a mapping change writes a new view
    key = hashlib.sha256(json.dumps([[(str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in info.files],
                                     info.config], sort_keys=True).encode()).hexdigest()[:16]
    out = settings.cache_dir("gguf") / f"{info.files[0].stem}-{key}"  # $MOE_OFFLOAD_CACHE_DIR/gguf
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(info.files[0].parent), gguf_file=info.files[0].name)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' converter is a model problem here
        raise ModelError(f"{info.files[0]}: transformers cannot build a tokenizer from the GGUF vocabulary "
                         f"({type(e).__name__}: {e})") from None
    tok.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(info.config, indent=1))
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote the same view first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


class Tensors:
    """The file's tensors by name: bytes checked against the file, numpy views over its memory map."""

    def __init__(self, info: gguf_meta.GGUFInfo):
        self.info = info
        self.t = {}
        self.file = {}  # name -> index into info.files
        for i, f in enumerate(info.files):
            for t in gguf_meta.open_reader(f).tensors:  # every tensor's bytes checked against the file's size
                self.t[t.name] = t
                self.file[t.name] = i

    def extent(self, name: str, e: int) -> tuple[int, int, int]:
        """(file index, byte offset, bytes) of expert ``e``'s slice of a [E, ..] tensor in its file."""
        t = self._get(name)
        experts = int(t.shape[-1])  # gguf lists dimensions innermost first: the expert is the last
        return self.file[name], int(t.data_offset) + e * (int(t.n_bytes) // experts), int(t.n_bytes) // experts

    def has(self, name: str) -> bool:
        return name in self.t

    def qtype(self, name: str) -> str:
        return self.t[name].tensor_type.name.lower()

    def float(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor dequantized (numpy order) in ``dtype``."""
        from gguf import quants

        t = self._get(name)
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise ModelError(f"{self.info.files[0]}: tensor {name} of type {t.tensor_type.name}: {e}") from None
        return torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)  # a copy: the map is read-only

    def blocks(self, name: str) -> torch.Tensor:
        """A quantized tensor's bytes as ggml blocks [.., R, nb, S] (a copy out of the map: the store owns it)."""
        t = self._get(name)
        kind = _engine_name(t.tensor_type.name.lower())
        if kind not in ggml.GGUF_TYPES:
            raise ModelError(f"{self.info.files[0]}: expert tensor {name} is {t.tensor_type.name}; the engine computes "
                             f"{', '.join(k.upper() for k in ggml.GGUF_TYPES)} experts as stored (or F32/F16/BF16)")
        cols = int(t.shape[0])
        return ggml.as_blocks(np.array(t.data, copy=True), kind, cols)

    def expert(self, name: str, e: int, dtype: torch.dtype, as_float: bool) -> torch.Tensor:
        """Expert ``e``'s slice of a [E, ..] tensor: its blocks (a copy of just that slice) or, ``as_float``,
        dequantized in ``dtype``."""
        t = self._get(name)
        if as_float:
            from gguf import quants

            arr = quants.dequantize(t.data[e], t.tensor_type)
            return torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)
        kind = _engine_name(t.tensor_type.name.lower())
        if kind not in ggml.GGUF_TYPES:
            self.blocks(name)  # the one-line error naming the type
        return ggml.as_blocks(np.array(t.data[e], copy=True), kind, int(t.shape[0]))

    def _get(self, name: str):
        if name not in self.t:
            raise ModelError(f"{self.info.files[0]}: expected tensor {name}, which the file lacks")
        return self.t[name]


def _engine_name(qtype: str) -> str:
    """The engine's format name of a ggml type name (GGUF's MXFP4 is gguf_mxfp4: "mxfp4" is gpt-oss's layout)."""
    return "gguf_mxfp4" if qtype == "mxfp4" else qtype


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a llama q/k weight (rows grouped per head as pairs of halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_map(info: gguf_meta.GGUFInfo):
    """gguf's transformers-name -> GGUF-name map for the file's architecture."""
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[info.arch]
    return gguf.get_tensor_name_map(arch, info.config["num_hidden_layers"])


def _gguf_name(tmap, name: str, layer_re=re.compile(r"\.layers\.(\d+)\.")) -> str | None:
    m = layer_re.search(name)
    if name.endswith("e_score_correction_bias") and m:
        return f"blk.{m[1]}.exp_probs_b.bias"
    if name.endswith("self_attn.sinks") and m:
        return f"blk.{m[1]}.attn_sinks.weight"
    return tmap.get_name(name, try_suffixes=(".weight", ".bias"))


def state_dict(tensors: Tensors, meta, experts: list, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every non-expert tensor of ``meta`` (the model on the meta device) from the file, in transformers' layout."""
    info = tensors.info
    cfg = info.config
    tmap = _tensor_map(info)
    modules = dict(meta.named_modules())
    routed = {f"{i.name}.{n}" for i in experts for n in ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias",
                                                          "down_proj_bias", "up_proj_bias")}
    out = {}
    for name, p in meta.state_dict().items():
        if name in routed:
            continue
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        pdtype = p.dtype if p.dtype == torch.float32 else dtype
        if name.endswith("kv_b_proj.weight") and not tensors.has(_gguf_name(tmap, name) or ""):
            out[name] = _kv_b(tensors, name, cfg, pdtype)
            continue
        src = _gguf_name(tmap, name)
        if src is None:
            raise ModelError(f"{info.files[0]}: no GGUF tensor maps to {name} ({info.arch})")
        w = tensors.float(src, pdtype)
        if info.arch == "llama" and re.search(r"\.(q|k)_proj\.weight$", name):
            w = _unpermute(w, cfg["num_attention_heads"] if ".q_proj" in name else cfg["num_key_value_heads"])
        out[name] = w.reshape(p.shape)
    for info_ in experts:  # per-expert biases (gpt-oss): gate|up interleaved as transformers holds them
        m = modules[info_.name]
        if getattr(m, "has_bias", False):
            layer = info_.layer
            g = tensors.float(f"blk.{layer}.ffn_gate_exps.bias", dtype)  # [E, I]
            u = tensors.float(f"blk.{layer}.ffn_up_exps.bias", dtype)
            out[f"{info_.name}.gate_up_proj_bias"] = torch.stack([g, u], dim=-1).flatten(-2)
            out[f"{info_.name}.down_proj_bias"] = tensors.float(f"blk.{layer}.ffn_down_exps.bias", dtype)
    return out


def _kv_b(tensors: Tensors, name: str, cfg: dict, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] from the converter's attn_k_b [heads, kv_lora, nope] (k part,
    transposed) and attn_v_b [heads, v, kv_lora]."""
    layer = re.search(r"\.layers\.(\d+)\.", name)[1]
    k = tensors.float(f"blk.{layer}.attn_k_b.weight", dtype)
    v = tensors.float(f"blk.{layer}.attn_v_b.weight", dtype)
    heads = cfg["num_attention_heads"]
    k = k.reshape(heads, cfg["kv_lora_rank"], cfg["qk_nope_head_dim"]).transpose(1, 2)
    v = v.reshape(heads, cfg["v_head_dim"], cfg["kv_lora_rank"])
    return torch.cat([k, v], dim=1).reshape(-1, cfg["kv_lora_rank"]).contiguous()


def read_experts(tensors: Tensors, info, module, dtype: torch.dtype, dequantize: bool = False,
                 expert: int | None = None) -> tuple:
    """(gate|up, down, None, None) of one layer as the store holds them: ggml blocks [E, 2I, nb, S] and [E, H, nb, S]
    (gpt-oss: gate and up rows interleaved), or float [E, 2I, H] / [E, H, I] for F32/F16/BF16 experts and with
    ``dequantize`` (--expert-dtype bf16). ``expert``: that expert's alone, each with a leading dimension of 1."""
    names = [f"blk.{info.layer}.{t}.weight" for t in gguf_meta.EXPERT_TENSORS]
    kinds = {tensors.qtype(n) for n in names[:2]}
    if len(kinds) != 1:
        raise ModelError(f"{tensors.info.files[0]}: layer {info.layer}'s ffn_gate_exps and ffn_up_exps are "
                         f"{' and '.join(sorted(kinds))}; the engine keeps a layer's gate|up in one type")
    interleave = getattr(module, "is_transposed", False)  # gpt-oss: its gate reads gate_up[..., ::2] / [..., 1::2]
    as_float = kinds <= {"f32", "f16", "bf16"} or dequantize
    if expert is None:
        g, u, d = ((tensors.float(n, dtype) if as_float else tensors.blocks(n)) for n in names)
    else:
        g, u, d = (tensors.expert(n, expert, dtype, as_float)[None] for n in names)
    gu = torch.stack([g, u], dim=2).flatten(1, 2) if interleave else torch.cat([g, u], dim=1)
    if as_float and interleave:  # the module's own transposed float layout
        return gu.transpose(1, 2).contiguous(), d.transpose(1, 2).contiguous(), None, None
    return gu, d, None, None


def store_dir(path, dtype: torch.dtype, dequantize: bool = False) -> tuple[Path, str]:
    """(where the expert store of GGUF ``path`` lives, its format name): keyed by the files' paths, sizes, mtimes
    and the format (the file's blocks, or ``dequantize``d to ``dtype``)."""
    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.hostmem import store_root

    files = gguf_meta.files_of(path)  # the names only: the header is not parsed here
    target = "gguf-" + (str(dtype).removeprefix("torch.") if dequantize else "blocks")
    h = hashlib.sha256(f"{target}|{diskstore.VERSION}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return store_root() / f"{files[0].stem}-{target}-{h.hexdigest()[:16]}", target


def keep_dense_blocks(model, tensors: Tensors) -> int:
    """Attention projections (q/k/v/o of a self_attn that has all four; MLA's q_a|kv_a (one block type), q_b and o),
    dense MLPs and shared experts (gate and up of one block type, so that one kernel call reads both) and the LM head
    whose file tensors are ggml blocks become BlockLinear over those blocks, as the file ships them (llama's q/k rows
    un-permuted); returns how many. The dequantized weights they replace are freed."""
    from moe_offload.engines.offload.loading.quant import DENSE_NAMES, MLP_NAMES, BlockLinear, dense_linears

    info = tensors.info
    tmap = _tensor_map(info)
    cfg = info.config

    def blocks_of(name: str, heads: int | None) -> torch.Tensor | None:
        src = _gguf_name(tmap, name)
        if src is None or not tensors.has(src) or _engine_name(tensors.qtype(src)) not in ggml.GGUF_TYPES:
            return None
        b = tensors.blocks(src)
        return _unpermute(b, heads) if heads else b

    def replace(name: str, module, attrs: tuple, together: tuple = (), heads: dict | None = None) -> int:
        """``attrs`` of ``module`` become BlockLinears, all or none (none unless ``together`` share a block type: one
        kernel call reads them)."""
        found = {a: blocks_of(f"{name}.{a}.weight", (heads or {}).get(a)) for a in attrs}
        if any(b is None for b in found.values()) or len({found[a].shape[1:] for a in together}) > 1:
            return 0
        for a, b in found.items():
            setattr(module, a, BlockLinear(b, getattr(module, a).bias))
        return len(attrs)

    def linear(module, a: str) -> bool:
        return type(getattr(module, a, None)) is torch.nn.Linear

    n = 0
    for name, module in list(model.named_modules()):
        if not name.endswith("self_attn"):
            continue
        if all(linear(module, a) for a in DENSE_NAMES):
            heads = ({"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
                     if info.arch == "llama" else None)
            n += replace(name, module, DENSE_NAMES, heads=heads)
        elif linear(module, "kv_a_proj_with_mqa"):  # MLA: each projection alone, q_a and kv_a as one pair
            pair = ("q_a_proj", "kv_a_proj_with_mqa") if linear(module, "q_a_proj") else ()
            for a in ("o_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa"):
                if linear(module, a) and a not in pair:
                    n += replace(name, module, (a,))
            if pair:
                n += replace(name, module, pair, together=pair)
    for name, mlp, attrs in dense_linears(model):  # gate and up of one type (one kernel call), down any
        if attrs == MLP_NAMES:
            n += replace(name, mlp, MLP_NAMES, together=MLP_NAMES[:2])
    head = getattr(model, "lm_head", None)
    if type(head) is torch.nn.Linear and not cfg["tie_word_embeddings"]:
        b = blocks_of("lm_head.weight", None)
        if b is not None:
            model.lm_head = BlockLinear(b, head.bias)
            n += 1
    return n


def load(path: str | os.PathLike, config, experts: list, dtype: torch.dtype, dequantize: bool = False,
         dense_blocks: bool = False, read: bool = True):
    """(model with placeholder experts, {experts module: (up, down, None, None)}); ``dequantize``: float experts;
    ``dense_blocks``: attention projections, MLPs and LM head kept as the file's blocks (keep_dense_blocks); ``read``:
    False reads no expert (the disk tier serves them from ensure_store's file) and returns {} for them."""
    from moe_offload.engines.offload.experts.executor import IMPLEMENTATION
    from moe_offload.engines.offload.loading.architecture import meta_model
    from moe_offload.engines.offload.loading.checkpoint import placeholders

    info = gguf_meta.read(path)
    tensors = Tensors(info)
    meta = meta_model(config, dtype)
    modules = dict(meta.named_modules())
    stored = {i.name: read_experts(tensors, i, modules[i.name], dtype, dequantize) for i in experts} if read else {}
    sd = state_dict(tensors, meta, experts, dtype)
    sd.update(placeholders(meta, experts, dtype))
    model = type(meta).from_pretrained(None, config=config, state_dict=sd, dtype=dtype,
                                       experts_implementation=IMPLEMENTATION)
    if config.tie_word_embeddings:
        model.tie_weights()
    if dense_blocks:
        keep_dense_blocks(model, tensors)
    model.config.name_or_path = str(info.files[0])
    return model, stored
