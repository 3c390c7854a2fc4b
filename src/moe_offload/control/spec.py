"""ModelSpec: the shape of a routed-MoE model, read from a Hugging Face ``config.json``.

From the shape follow the numbers the planner needs: bytes of one expert, of
each layer's experts, of the dense weights (attention, norms, router, shared
experts), embeddings and LM head; KV-cache bytes per token; total and active
parameters. Counts mirror the parameter tensors transformers builds for each
family (a test checks them against meta-device models), so they also match
what a checkpoint stores.

Bytes count what is stored: a quantized checkpoint's experts in their format
(``quantization_config``: gpt-oss MXFP4, DeepSeek-style block FP8), or the format
``--expert-dtype`` gives them (``with_expert_dtype``); the host store, the slots
and every fetch hold and move exactly these bytes. Non-expert weights are held in
the compute dtype (an FP8 checkpoint's linears are dequantized at load);
``checkpoint_bytes`` prices the files as shipped.

H hidden, I expert intermediate, E routed experts, K top-k, V vocab,
nh query heads, nkv KV heads, hd head dim.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from moe_offload.control import hf_config, layerkinds
from moe_offload.control.kvsizes import KVSizes
from moe_offload.control.vocab import EXPERT_DTYPES, QUANTIZED_FORMATS
from moe_offload.control.weightbytes import WeightBytes
from moe_offload.errors import ConfigError, ModelError

ATTENTION_KINDS = layerkinds.KNOWN  # kinds priced here; any other name is carried through (see layerkinds)


@dataclass(frozen=True)
class ModelSpec(WeightBytes, KVSizes):
    """Architecture of a routed-MoE decoder. Sizes in elements; ``*_bytes`` use ``dtype_bytes``."""

    name: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared-expert MLP (n_shared x its size)
    shared_expert_gate: bool = False  # qwen2_moe: a sigmoid gate Linear(H, 1) on the shared expert
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    dtype_bytes: int = 2
    # attention
    attention: str = "gqa"  # gqa | mla
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    attention_sinks: bool = False
    qk_norm: str = ""  # "" | head (per-head norms) | full (over all heads)
    # MLP / router extras
    expert_bias: bool = False
    router_bias: bool = False
    router_correction_bias: bool = False  # DeepSeek-V3-style e_score_correction_bias [E]
    norm_bias: bool = False
    lm_head_bias: bool = False
    quantization: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # layer kinds beyond attention (layerkinds.py)
    linear_design: str = ""  # what linear_attention layers are: lightning | gated_deltanet | kda | mamba | mamba2 | ""
    linear_sizes: Mapping[str, int] = field(default_factory=dict)
    conv_kernel: int = 0  # LFM2-style short-convolution layers (kind "conv")
    indexer_heads: int = 0  # DeepSeek sparse attention's indexer (kind "indexed_attention")
    indexer_head_dim: int = 0
    attention_output_gate: bool = False  # Qwen3-Next: q_proj also yields a sigmoid gate on the output
    mlp_gated: bool = True  # False: experts, shared and dense MLPs are up/down only (Nemotron-H's relu2)
    single_block: bool = False  # Nemotron-H: a layer is one block (a mixer or an MLP) with one norm
    vision_params: int = 0  # a multimodal model's vision tower
    estimated: tuple[str, ...] = ()  # what could not be priced exactly, in words
    # storage: the experts' format in memory ("" = dtype) and as the checkpoint ships them
    expert_format: str = ""
    checkpoint_expert_format: str = ""
    act_order: bool = False  # an act-order 4-bit release: each expert projection keeps its input order (int32 [K])
    attention_quantized: bool = True  # an FP8 / NVFP4 release ships its attention linears quantized
    # a GGUF file: each MoE layer's expert as stored (its block types; Q4_K_M mixes them per layer) and all tensors,
    # read from the file, not derived from the shape
    stored_layer_expert_bytes: tuple[int, ...] = ()
    file_bytes: int = 0

    def __post_init__(self):
        for f in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate_size", "vocab_size",
                  "num_attention_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(f"{self.name}: {f} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ModelError(f"{self.name}: experts per token ({self.top_k}) exceeds routed experts ({self.num_experts})")
        if not self.moe_layers:
            raise ModelError(f"{self.name}: no routed-MoE layers among {self.num_layers} layers")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ModelError(f"{self.name}: MoE layer indices {self.moe_layers} outside 0..{self.num_layers - 1}")
        types = self.layer_types or ("full_attention",) * self.num_layers
        if len(types) != self.num_layers or not all(isinstance(t, str) and t for t in types):
            raise ModelError(f"{self.name}: layer_types must be {self.num_layers} layer kind names, got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(types))
        object.__setattr__(self, "moe_layers", tuple(sorted(self.moe_layers)))
        if self.dense_layers and self.dense_intermediate_size < 1:
            raise ModelError(f"{self.name}: config has dense layers {self.dense_layers} but no intermediate_size")
        if self.attention not in ("gqa", "mla"):
            raise ModelError(f"{self.name}: attention must be gqa or mla, got {self.attention!r}")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> "ModelSpec":
        """Spec from a checkpoint directory, a ``config.json`` path, or the parsed dict."""
        if isinstance(source, Mapping):
            cfg = dict(source)
        else:
            cfg = hf_config.load_config(source)
            if name is None:
                p = os.path.abspath(os.fspath(source))
                name = (os.path.basename(p).removesuffix(".gguf") if p.endswith(".gguf")
                        else os.path.basename(p if os.path.isdir(p) else os.path.dirname(p)))
        return cls(**hf_config.parse(cfg, name))

    # ---- layers -------------------------------------------------------------------------------

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers with a dense MLP (Nemotron-H: its "mlp" blocks; its mixer-only layers have none)."""
        moe = set(self.moe_layers)
        if self.single_block:
            return tuple(i for i, t in enumerate(self.layer_types) if t == "mlp" and i not in moe)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    # ---- parameters per component -------------------------------------------------------------

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up, down (+ biases where the family has them)."""
        H, I = self.hidden_size, self.expert_intermediate_size
        return self._mats * H * I + ((2 * I + H) if self.expert_bias else 0)

    @property
    def _mats(self) -> int:
        """Weight matrices of one MLP: gate, up, down; or up, down where the MLP has no gate."""
        return 3 if self.mlp_gated else 2

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer (one fused MLP), with the shared gate."""
        H = self.hidden_size
        return self._mats * H * self.shared_intermediate_size + (H if self.shared_expert_gate else 0)

    @property
    def router_params(self) -> int:
        E = self.num_experts
        return self.hidden_size * E + (E if self.router_bias else 0) + (E if self.router_correction_bias else 0)

    @property
    def dense_mlp_params(self) -> int:
        return self._mats * self.hidden_size * self.dense_intermediate_size

    def attention_params(self, layer: int) -> int:
        """The token mixer of ``layer``, by its kind (layerkinds.py); kinds not priced count as attention."""
        kind = self.layer_types[layer]
        H = self.hidden_size
        if kind in layerkinds.NO_MIXER:
            return 0
        if kind == "linear_attention":
            n = layerkinds.linear_params(self.linear_design, H, self.linear_sizes)
            if n is not None:
                return n
        if kind == "conv":  # LFM2 short convolution: in_proj (B, C, x), depthwise conv, out_proj
            return 3 * H * H + H * self.conv_kernel + H * H
        n = self._attention_params()
        if kind == "indexed_attention":
            n += layerkinds.indexer_params(H, self.q_lora_rank, self.indexer_heads, self.indexer_head_dim)
        return n

    def _attention_params(self) -> int:
        H, nh, nkv, hd = self.hidden_size, self.num_attention_heads, self.num_kv_heads, self.head_dim
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r, kv = self.q_lora_rank, self.kv_lora_rank
            q = H * r + r + r * nh * qk if r else H * nh * qk
            kv_a = H * (kv + self.qk_rope_head_dim) + kv
            kv_b = kv * nh * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + nh * self.v_head_dim * H
        n = (3 if self.attention_output_gate else 2) * H * nh * hd + 2 * H * nkv * hd
        if self.qkv_bias:
            n += nh * hd + 2 * nkv * hd
        if self.o_bias:
            n += H
        if self.attention_sinks:
            n += nh
        if self.qk_norm == "head":
            n += 2 * hd
        elif self.qk_norm == "full":
            n += nh * hd + nkv * hd
        return n

    @property
    def norm_params(self) -> int:
        """One RMSNorm/LayerNorm over H."""
        return self.hidden_size * (2 if self.norm_bias else 1)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied to the embeddings (the weights are stored once)."""
        if self.tie_word_embeddings:
            return self.vocab_size if self.lm_head_bias else 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    def layer_dense_params(self, layer: int) -> int:
        """Everything of one decoder layer except its routed experts."""
        if self.single_block:  # one block per layer: a mixer, an MoE or a dense MLP, behind one norm
            kind = self.layer_types[layer]
            mlp = self.router_params + self.shared_expert_params if layer in self._moe_set else \
                self.dense_mlp_params if kind == "mlp" else 0
            return self.attention_params(layer) + mlp + self.norm_params
        n = self.attention_params(layer) + 2 * self.norm_params
        if layer in self._moe_set:
            n += self.router_params + self.shared_expert_params
        else:
            n += self.dense_mlp_params
        return n

    @property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    # ---- totals -------------------------------------------------------------------------------

    @property
    def routed_expert_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def non_expert_params(self) -> int:
        layers = sum(self.layer_dense_params(i) for i in range(self.num_layers))
        return layers + self.embedding_params + self.lm_head_params + self.norm_params + self.vision_params

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.routed_expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: everything but the unrouted experts. Counts the embedding
        table in full, as the Mixtral, Qwen and OLMoE model cards do (OpenAI's gpt-oss card
        leaves the embedding out: ``active_params - embedding_params``)."""
        return self.non_expert_params + self.num_moe_layers * self.top_k * self.expert_params

    # ---- bytes (WeightBytes: weightbytes.py) ---------------------------------------------------

    def with_expert_dtype(self, expert_dtype: str | None) -> "ModelSpec":
        """The spec with experts held as ``--expert-dtype`` makes them: "int8" | "fp8" quantize a float checkpoint's
        experts, "bf16" holds them in bf16 (dequantized from a quantized checkpoint); None: as the checkpoint ships."""
        if expert_dtype is None:
            return self
        if expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"expert_dtype: expected one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
        fmt, stored = EXPERT_DTYPES[expert_dtype], self.checkpoint_expert_format
        if self.stored_layer_expert_bytes and fmt != "bfloat16":
            raise ConfigError(f"expert_dtype {expert_dtype!r}: a GGUF file's experts stay in its quant types; expected "
                              "bf16 (dequantize at load) or unset (keep them as stored)")
        if stored in QUANTIZED_FORMATS and fmt != "bfloat16" and fmt != stored:
            raise ConfigError(f"expert_dtype {expert_dtype!r}: this checkpoint's experts are {stored}; expected bf16 "
                              f"(dequantize at load) or {stored} / unset (keep them as stored)")
        return replace(self, expert_format=fmt)

    @property
    def disk_in_place(self) -> bool:
        """Prediction (the engine decides on the files, convert.py): whether the disk tier reads the experts from the
        checkpoint's own files, with no store copy: experts kept as shipped (no --expert-dtype conversion), float
        safetensors or a GGUF file's blocks, in a layout the engine computes from (the family registry's
        ``expert_layout``: not a transposed one)."""
        from moe_offload.control.families import family_of

        family = family_of(self.model_type)
        kept = self.expert_format == self.checkpoint_expert_format
        return (kept and (family is None or family.expert_layout == "rows")
                and (self.quantization is None or bool(self.stored_layer_expert_bytes)))

    @property
    def disk_copy_bytes(self) -> int:
        """Bytes of disk the expert store copy needs (0 when the experts are read in place): every routed expert as
        the engine holds it, records padded to 4 KiB (a prediction)."""
        if self.disk_in_place:
            return 0
        per = -(-self.expert_bytes // 4096) * 4096
        return self.num_moe_layers * self.num_experts * per

    # ---- output -------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Shape and derived numbers, JSON-ready."""
        d = asdict(self)
        d["extra"] = dict(self.extra)
        d.update(
            dense_layers=list(self.dense_layers),
            total_params=self.total_params,
            active_params=self.active_params,
            expert_params=self.expert_params,
            expert_bytes=self.expert_bytes,
            layer_expert_bytes=self.layer_expert_bytes,
            stored_layer_expert_bytes=list(self.stored_layer_expert_bytes),
            routed_expert_bytes=self.routed_expert_bytes,
            expert_format=self.expert_format or self.dtype,
            checkpoint_bytes=self.checkpoint_bytes,
            dense_bytes=self.dense_bytes,
            embedding_bytes=self.embedding_bytes,
            lm_head_bytes=self.lm_head_bytes,
            non_expert_bytes=self.non_expert_bytes,
            total_bytes=self.total_bytes,
            disk_in_place=self.disk_in_place,
            disk_copy_bytes=self.disk_copy_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_unknown_kinds=list(self.kv_unknown_kinds),
        )
        d["linear_sizes"] = dict(self.linear_sizes)
        d["estimated"] = list(self.estimated)
        return d
