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

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from moe_offload.control import layerkinds
from moe_offload.control.vocab import DTYPE_BYTES, EXPERT_DTYPES, FP8_BLOCK, QUANTIZED_FORMATS, stored_weight_bytes
from moe_offload.errors import ConfigError, ModelError

ATTENTION_KINDS = layerkinds.KNOWN  # kinds priced here; any other name is carried through (see layerkinds)
# Keys that name the number of routed experts, in the order families use them.
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_k", "num_experts_per_token", "moe_topk", "top_k_experts")
# Families whose q/k/v projections take a bias but whose o_proj never does.
_QKV_ONLY_BIAS = {"glm4_moe", "solar_open", "qwen2_moe"}


@dataclass(frozen=True)
class ModelSpec:
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
            cfg = load_config(source)
            if name is None:
                p = os.path.abspath(os.fspath(source))
                name = os.path.basename(p if os.path.isdir(p) else os.path.dirname(p))
        return _parse(cfg, name)

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

    # ---- bytes --------------------------------------------------------------------------------

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as held in memory (its format: ``expert_format``, default the dtype)."""
        return self.stored_expert_bytes(self.expert_format or self.dtype)

    def stored_expert_bytes(self, fmt: str) -> int:
        """Bytes of one routed expert stored in ``fmt`` (a quantized format, or a float dtype name); biases keep
        the dtype. A concatenated gate|up in fp8 keeps the halves' blocks apart (gpt-oss interleaves them)."""
        H, I = self.hidden_size, self.expert_intermediate_size
        if fmt not in QUANTIZED_FORMATS:
            return self.expert_params * DTYPE_BYTES[fmt]
        split = I if fmt == "fp8" and self.model_type != "gpt_oss" else 0
        bias = (2 * I + H) * self.dtype_bytes if self.expert_bias else 0
        return stored_weight_bytes(fmt, 2 * I, H, split) + stored_weight_bytes(fmt, H, I) + bias

    @property
    def layer_expert_bytes(self) -> int:
        """Bytes of one MoE layer's routed experts."""
        return self.num_experts * self.expert_bytes

    @property
    def routed_expert_bytes(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint's tensors as shipped: experts in ``checkpoint_expert_format``; in an FP8 release
        also every linear but the router and LM head in block FP8, and the routing correction bias in fp32."""
        fmt = self.checkpoint_expert_format or self.dtype
        experts = self.num_moe_layers * self.num_experts * self.stored_expert_bytes(fmt)
        rest = self.non_expert_bytes
        if fmt == "fp8":
            shapes = [s for i in range(self.num_layers) for s in self.layer_linear_shapes(i)]
            rest += sum(stored_weight_bytes("fp8", r, c) - r * c * self.dtype_bytes for r, c in shapes)
            if self.router_correction_bias:
                rest += self.num_moe_layers * self.num_experts * (4 - self.dtype_bytes)
        return rest + experts

    def layer_linear_shapes(self, layer: int) -> list[tuple[int, int]]:
        """[out, in] of every linear weight of one decoder layer but the routed experts and the router: attention
        and the dense or shared-expert MLP (what an FP8 release quantizes)."""
        H, nh, nkv, hd = self.hidden_size, self.num_attention_heads, self.num_kv_heads, self.head_dim
        if self.layer_types[layer] == "linear_attention":
            inner = nh * hd
            shapes = [(3 * inner, H), (H, inner), (inner, H)]
        elif self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r, kv = self.q_lora_rank, self.kv_lora_rank
            q = [(r, H), (nh * qk, r)] if r else [(nh * qk, H)]
            shapes = q + [(kv + self.qk_rope_head_dim, H), (nh * (self.qk_nope_head_dim + self.v_head_dim), kv),
                          (H, nh * self.v_head_dim)]
        else:
            shapes = [(nh * hd, H), (nkv * hd, H), (nkv * hd, H), (H, nh * hd)]
        inter = self.shared_intermediate_size if layer in self._moe_set else self.dense_intermediate_size
        if inter:
            shapes += [(inter, H), (inter, H), (H, inter)]
        if layer in self._moe_set and self.shared_expert_gate:
            shapes.append((1, H))
        return shapes

    def with_expert_dtype(self, expert_dtype: str | None) -> "ModelSpec":
        """The spec with experts held as ``--expert-dtype`` makes them: "int8" | "fp8" quantize a float checkpoint's
        experts, "bf16" holds them in bf16 (dequantized from a quantized checkpoint); None: as the checkpoint ships."""
        if expert_dtype is None:
            return self
        if expert_dtype not in EXPERT_DTYPES:
            raise ConfigError(f"expert_dtype: expected one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
        fmt, stored = EXPERT_DTYPES[expert_dtype], self.checkpoint_expert_format
        if stored in QUANTIZED_FORMATS and fmt != "bfloat16" and fmt != stored:
            raise ConfigError(f"expert_dtype {expert_dtype!r}: this checkpoint's experts are {stored}; expected bf16 "
                              f"(dequantize at load) or {stored} / unset (keep them as stored)")
        return replace(self, expert_format=fmt)

    @property
    def embedding_bytes(self) -> int:
        return self.embedding_params * self.dtype_bytes

    @property
    def lm_head_bytes(self) -> int:
        return (self.lm_head_params + self.norm_params) * self.dtype_bytes  # with the final norm

    def layer_dense_bytes(self, layer: int) -> int:
        return self.layer_dense_params(layer) * self.dtype_bytes

    @property
    def dense_bytes(self) -> int:
        """Attention, norms, routers, shared experts and dense MLPs of all layers."""
        return sum(self.layer_dense_bytes(i) for i in range(self.num_layers))

    @property
    def non_expert_bytes(self) -> int:
        return self.non_expert_params * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        """Non-expert weights in the compute dtype plus the routed experts in their format (what a load holds)."""
        return self.non_expert_bytes + self.routed_expert_bytes

    # ---- KV cache -----------------------------------------------------------------------------

    def kv_bytes_per_token_layer(self, layer: int) -> int:
        """KV-cache bytes one token adds in ``layer``: 0 for kinds with a constant state or none, and for kinds
        whose cache is not known here (``kv_unknown_kinds`` names them)."""
        kind = self.layer_types[layer]
        if kind not in layerkinds.GROWING:
            return 0
        if self.attention == "mla":  # the compressed latent + the shared rope key
            n = (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        else:
            n = 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes
        if kind == "indexed_attention":  # the indexer keeps one key per token as well
            n += self.indexer_head_dim * self.dtype_bytes
        return n

    def state_bytes_layer(self, layer: int) -> int:
        """Per-sequence state of a constant-state layer (linear attention, conv); 0 for the others."""
        kind = self.layer_types[layer]
        if kind == "linear_attention":
            return layerkinds.linear_state_bytes(self.linear_design, self.linear_sizes, self.dtype_bytes) or 0
        if kind == "conv":
            return self.hidden_size * self.conv_kernel * self.dtype_bytes
        return 0

    @property
    def kv_unknown_kinds(self) -> tuple[str, ...]:
        """Layer kinds whose cache size is not known here: the KV budget counts them as 0."""
        unknown = {t for t in self.layer_types if t not in layerkinds.KNOWN}
        if "linear_attention" in self.layer_types and layerkinds.linear_params(
                self.linear_design, self.hidden_size, self.linear_sizes) is None:
            unknown.add("linear_attention")
        return tuple(sorted(unknown))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token adds over all layers while the context is within every sliding window."""
        return sum(self.kv_bytes_per_token_layer(i) for i in range(self.num_layers))

    def kv_cache_bytes(self, context: int, batch: int = 1, layers=None) -> int:
        """KV cache for ``batch`` sequences of ``context`` tokens (of ``layers``, default all): sliding
        layers keep at most ``sliding_window`` tokens, linear-attention layers a constant [nh, hd, hd] fp32 state."""
        if context < 0 or batch < 0:
            raise ConfigError(f"context and batch must be >= 0, got context={context} batch={batch}")
        total = 0
        for i in range(self.num_layers) if layers is None else layers:
            kind = self.layer_types[i]
            if kind in layerkinds.CONSTANT:
                total += self.state_bytes_layer(i)
            elif kind == "sliding_attention" and self.sliding_window:
                total += self.kv_bytes_per_token_layer(i) * min(context, self.sliding_window)
            else:
                total += self.kv_bytes_per_token_layer(i) * context
        return total * batch

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
            routed_expert_bytes=self.routed_expert_bytes,
            expert_format=self.expert_format or self.dtype,
            checkpoint_bytes=self.checkpoint_bytes,
            dense_bytes=self.dense_bytes,
            embedding_bytes=self.embedding_bytes,
            lm_head_bytes=self.lm_head_bytes,
            non_expert_bytes=self.non_expert_bytes,
            total_bytes=self.total_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_unknown_kinds=list(self.kv_unknown_kinds),
        )
        d["linear_sizes"] = dict(self.linear_sizes)
        d["estimated"] = list(self.estimated)
        return d


def load_config(source: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory or config path."""
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"no config.json at {path}")
    return read_json(path)


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``; ConfigError (one line: path and what is wrong) for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# ---- parsing --------------------------------------------------------------------------------------


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...], default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _int(cfg: Mapping[str, Any], key: str, where: str, default: Any = ...) -> int:
    v = cfg.get(key)
    if v is None:
        if default is ...:
            raise ModelError(f"{where}: config.json lacks {key!r}")
        return default
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):  # some families list a size per layer
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def _moe_layers(cfg: Mapping[str, Any], n: int, types: tuple[str, ...], where: str) -> tuple[int, ...]:
    """Which decoder layers are routed MoE. transformers' own per-layer declaration first (``mlp_layer_types``,
    Nemotron-H's "moe" blocks), then each family's rule for configs that predate it. The engine takes the MoE
    layers from the experts modules the model builds; tests check this rule against them for every family."""
    mlp_types = cfg.get("mlp_layer_types")
    if isinstance(mlp_types, list) and len(mlp_types) == n:
        return tuple(i for i, t in enumerate(mlp_types) if t != "dense")
    if "moe" in types:  # Nemotron-H: each layer is one block, "moe" the routed ones
        return tuple(i for i, t in enumerate(types) if t == "moe")
    if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:  # qwen2_moe, qwen3_moe
        only = set(cfg.get("mlp_only_layers") or ())
        step = _int(cfg, "decoder_sparse_step", where, 1) or 1
        return tuple(i for i in range(n) if i not in only and (i + 1) % step == 0)
    if "first_k_dense_replace" in cfg:  # deepseek, glm4_moe
        k = _int(cfg, "first_k_dense_replace", where, 0)
        freq = _int(cfg, "moe_layer_freq", where, 1) or 1
        return tuple(i for i in range(n) if i >= k and i % freq == 0)
    if "moe_layer_start_index" in cfg:  # ernie4_5_moe
        start = _int(cfg, "moe_layer_start_index", where, 0)
        end = _int(cfg, "moe_layer_end_index", where, -1)
        end = n - 1 if end == -1 else end
        every = _int(cfg, "moe_layer_interval", where, 1) or 1
        return tuple(i for i in range(n) if (i + 1) % every == 0 and start <= i <= end)
    if isinstance(cfg.get("moe_layers"), list):  # llama4-style explicit list
        return tuple(int(i) for i in cfg["moe_layers"])
    if "interleave_moe_layer_step" in cfg:
        step = _int(cfg, "interleave_moe_layer_step", where, 1) or 1
        return tuple(i for i in range(n) if (i + 1) % step == 0)
    if "expert_layer_period" in cfg:  # jamba
        period = _int(cfg, "expert_layer_period", where, 1) or 1
        offset = _int(cfg, "expert_layer_offset", where, 0)
        return tuple(i for i in range(n) if i % period == offset)
    if "num_dense_layers" in cfg:  # afmoe, lfm2_moe: the first layers are dense
        k = _int(cfg, "num_dense_layers", where, 0)
        return tuple(range(k, n))
    return tuple(range(n))


def _num_layers(cfg: Mapping[str, Any], where: str) -> int:
    """num_hidden_layers, or the length of the layer pattern where a config gives only that (Nemotron-H)."""
    if cfg.get("num_hidden_layers") is not None:
        return _int(cfg, "num_hidden_layers", where)
    for key in ("layers_block_type", "hybrid_override_pattern", "layer_types"):
        if isinstance(cfg.get(key), (list, str)) and cfg[key]:
            return len(cfg[key])
    raise ModelError(f"{where}: config.json lacks 'num_hidden_layers' (and has no layer pattern to count)")


def _layer_types(cfg: Mapping[str, Any], model_type: str, n: int, where: str) -> tuple[str, ...]:
    """Each layer's kind, as transformers' config class derives it; names are carried through as given."""
    for key in ("layer_types", "layers_block_type"):
        types = cfg.get(key)
        if isinstance(types, list):
            if len(types) != n:
                raise ModelError(f"{where}: {key} has {len(types)} entries, expected num_hidden_layers={n}")
            return tuple("linear_attention" if t == "mamba" else str(t) for t in types)
    if isinstance(cfg.get("hybrid_override_pattern"), str):  # Nemotron-H
        types = layerkinds.hybrid_pattern(cfg["hybrid_override_pattern"])
        if len(types) != n:
            raise ModelError(f"{where}: hybrid_override_pattern has {len(types)} layers, expected num_hidden_layers={n}")
        return types
    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax-Text-01: 0 = lightning (linear), 1 = softmax
        return tuple("full_attention" if t else "linear_attention" for t in cfg["attn_type_list"])
    lac = cfg.get("linear_attn_config")
    if isinstance(lac, dict) and isinstance(lac.get("full_attn_layers"), list):  # Kimi-Linear, 1-based indices
        full = {int(i) - 1 for i in lac["full_attn_layers"]}
        return tuple("full_attention" if i in full else "linear_attention" for i in range(n))
    if "attn_layer_period" in cfg:  # Jamba: attention every period layers, Mamba elsewhere
        period = _int(cfg, "attn_layer_period", where, 1) or 1
        offset = _int(cfg, "attn_layer_offset", where, 0)
        return tuple("full_attention" if i % period == offset else "linear_attention" for i in range(n))
    if "full_attention_interval" in cfg or model_type == "qwen3_next":  # Qwen3-Next: every 4th layer full
        every = _int(cfg, "full_attention_interval", where, 4) or 4
        return tuple("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n))
    if cfg.get("index_topk") is not None:  # DeepSeek-V3.2, GLM-5 (DSA): every layer has the indexer
        return ("indexed_attention",) * n
    # The defaults transformers' config classes fill in when the key is absent.
    if model_type == "minimax":
        return tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n))
    if model_type == "gpt_oss":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
    if model_type == "qwen2_moe":
        use, upto = cfg.get("use_sliding_window", False), cfg.get("max_window_layers", n)
        return tuple("sliding_attention" if use and (i + 1) % 2 and i < upto else "full_attention" for i in range(n))
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):  # mixtral/phimoe: every layer
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def _dtype(cfg: Mapping[str, Any], where: str) -> tuple[str, int]:
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    name = str(raw).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ModelError(f"{where}: unknown dtype {raw!r} (expected one of {', '.join(sorted(DTYPE_BYTES))})")
    return name, DTYPE_BYTES[name]


# Decoder model types whose parameter count the rules here give exactly: tests/engines/offload/test_families.py checks
# every family against the model transformers builds, and fails when this list claims too much or too little.
# Other types are priced by the same rules, and the spec says so in ``estimated``.
PRICED = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe", "flex_olmo", "flint", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "jamba", "kimi_linear", "lfm2_moe", "mellum", "minimax", "minimax_m2", "mistral4", "mixtral", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_vl_moe_text", "solar_open",
})
# Sub-config keys under which multimodal and omni wrappers keep their text decoder.
_TEXT_KEYS = ("text_config", "thinker_config", "llm_config", "language_config")
# Families whose router keeps a per-expert score-correction bias (noaux_tc routing) without saying so in topk_method.
_CORRECTION_BIAS = {"deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "solar_open", "ernie4_5_moe", "kimi_linear",
                    "nemotron_h", "minimax_m2"}


def _text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the decoder's config, the outermost config): multimodal wrappers (qwen3_vl_moe, gemma4, ...) keep the
    decoder in text_config, omni models one level deeper (thinker_config.text_config)."""
    outer = cfg
    while "num_hidden_layers" not in cfg and not any(k in cfg for k in ("layers_block_type", "hybrid_override_pattern")):
        inner = next((cfg[k] for k in _TEXT_KEYS if isinstance(cfg.get(k), dict)), None)
        if inner is None:
            break
        cfg = {**inner}
        cfg.setdefault("torch_dtype", outer.get("torch_dtype") or outer.get("dtype"))
        cfg.setdefault("_name_or_path", outer.get("_name_or_path"))
        cfg.setdefault("quantization_config", outer.get("quantization_config"))
    if cfg is not outer and "tie_word_embeddings" in outer:  # the wrapper's model owns the LM head: its flag counts
        cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
    return cfg, outer


def _sub_config(outer: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A tower's config (vision_config, audio_config) of a multimodal wrapper, or of its omni thinker."""
    for holder in (outer, *(outer[k] for k in _TEXT_KEYS if isinstance(outer.get(k), dict))):
        if isinstance(holder.get(key), dict):
            return holder[key]
    return None


def _parse(cfg: dict[str, Any], name: str | None) -> ModelSpec:
    cfg, outer = _text_config(cfg)
    model_type = str(cfg.get("model_type") or "unknown")
    name = name or cfg.get("_name_or_path") or outer.get("_name_or_path") or model_type
    where = f"{name} ({model_type})"
    E = _first(cfg, EXPERT_KEYS)
    if not E:
        raise ModelError(f"{where}: not a routed MoE model: no num_experts / n_routed_experts / num_local_experts")
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ModelError(f"{where}: number of routed experts must be a positive integer, got {E!r}")
    top_k = _first(cfg, TOP_K_KEYS)
    if top_k is None:
        raise ModelError(f"{where}: config.json lacks 'num_experts_per_tok' (experts per token)")
    n = _num_layers(cfg, where)
    H = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    nkv = _int(cfg, "num_key_value_heads", where, nh) or nh
    hd = _int(cfg, "head_dim", where, 0) or H // nh
    moe_inter_key = "moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None else "intermediate_size"
    expert_I = _int(cfg, moe_inter_key, where)
    # Dense layers use intermediate_size; where the experts use it too (jamba, mixtral), so do the dense layers.
    dense_I = _int(cfg, "intermediate_size", where, 0) or (expert_I if moe_inter_key == "intermediate_size" else 0)
    types = _layer_types(cfg, model_type, n, where)
    moe_layers = _moe_layers(cfg, n, types, where)
    single_block = model_type == "nemotron_h"

    # Shared experts: deepseek/glm/solar/ernie fuse n of them into one MLP; qwen2_moe sizes its one directly.
    n_shared = _int(cfg, "n_shared_experts", where, 0) or _int(cfg, "moe_num_shared_experts", where, 0) \
        or _int(cfg, "num_shared_experts", where, 0)
    shared_I, shared_gate = n_shared * expert_I, False
    if cfg.get("shared_expert_intermediate_size"):
        n_shared, shared_I, shared_gate = max(n_shared, 1), _int(cfg, "shared_expert_intermediate_size", where), True
    elif cfg.get("moe_shared_expert_intermediate_size"):  # nemotron_h: n_shared x this width, no gate
        shared_I = max(n_shared, 1) * _int(cfg, "moe_shared_expert_intermediate_size", where)
    elif cfg.get("shared_intermediate_size"):  # granitemoeshared
        n_shared, shared_I = max(n_shared, 1), _int(cfg, "shared_intermediate_size", where)

    mla = cfg.get("kv_lora_rank") is not None
    attn_bias = bool(cfg.get("attention_bias", model_type == "gpt_oss")) or bool(cfg.get("use_bias", False))
    qkv_bias = bool(cfg.get("qkv_bias", model_type == "qwen2_moe")) or attn_bias
    o_bias = attn_bias and model_type not in _QKV_ONLY_BIAS
    qk_norm = ""
    if cfg.get("qk_norm_type") == "per_layer" or model_type in ("olmoe", "flex_olmo", "minimax_m2"):  # over all heads
        qk_norm = "full"
    elif model_type in ("qwen3_moe", "qwen3_next", "qwen3_vl_moe_text", "qwen3_5_moe_text") or cfg.get("use_qk_norm"):
        qk_norm = "head"
    dtype, dtype_bytes = _dtype(cfg, where)
    quant = cfg.get("quantization_config")
    stored = _checkpoint_expert_format(quant, where)
    sliding = cfg.get("sliding_window")

    estimated = [] if model_type in PRICED else [f"{model_type} layers: priced by the common rules, not checked"]
    design = layerkinds.linear_design(cfg, model_type) if "linear_attention" in types else ""
    sizes = layerkinds.linear_sizes(cfg, design, H, nh, hd) if design else {}
    if sizes and any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in sizes.values()):
        raise ModelError(f"{where}: {design} linear attention needs integer sizes, got {sizes}")
    if "linear_attention" in types and not design:
        estimated.append("linear_attention layers: design not known here, priced as attention, state not counted")
    for kind in sorted(set(types) - set(layerkinds.KNOWN)):
        estimated.append(f"{kind} layers: priced as attention, KV cache not counted")
    if _sub_config(outer, "audio_config") is not None:
        estimated.append("audio tower: not counted")
    vision = _sub_config(outer, "vision_config")
    vision_params = layerkinds.vision_params(vision) if vision else 0
    if vision_params is None:
        vision_params = 0
        estimated.append("vision tower: not counted")

    return ModelSpec(
        name=str(name),
        model_type=model_type,
        num_layers=n,
        moe_layers=moe_layers,
        num_experts=E,
        top_k=int(top_k[0] if isinstance(top_k, list) else top_k),
        hidden_size=H,
        expert_intermediate_size=expert_I,
        dense_intermediate_size=dense_I,
        vocab_size=_int(cfg, "vocab_size", where),
        num_attention_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        num_shared_experts=n_shared,
        shared_intermediate_size=shared_I,
        shared_expert_gate=shared_gate,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "ernie4_5_moe")),
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        attention="mla" if mla else "gqa",
        q_lora_rank=_int(cfg, "q_lora_rank", where, None) if mla else None,
        kv_lora_rank=_int(cfg, "kv_lora_rank", where, 0) if mla else 0,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where) if mla else 0,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where) if mla else 0,
        v_head_dim=_int(cfg, "v_head_dim", where) if mla else 0,
        layer_types=types,
        sliding_window=int(sliding) if isinstance(sliding, int) and sliding > 0 else None,
        qkv_bias=qkv_bias and not mla,
        o_bias=o_bias and not mla,
        attention_sinks=model_type == "gpt_oss",
        qk_norm=qk_norm,
        expert_bias=model_type == "gpt_oss",
        router_bias=model_type == "gpt_oss",
        # the e_score_correction_bias of noaux_tc routing; ernie keeps the same vector as moe_statics
        router_correction_bias=cfg.get("topk_method") == "noaux_tc" or model_type in _CORRECTION_BIAS,
        norm_bias=model_type == "phimoe",
        lm_head_bias=bool(cfg.get("lm_head_bias", False)) or (bool(cfg.get("use_bias", False)) and not single_block),
        quantization=(quant.get("quant_method") if isinstance(quant, dict) else None),
        extra={k: cfg[k] for k in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob") if k in cfg},
        linear_design=design,
        linear_sizes=sizes,
        conv_kernel=_int(cfg, "conv_L_cache", where, 3) if "conv" in types else 0,
        indexer_heads=_int(cfg, "index_n_heads", where, 0) if "indexed_attention" in types else 0,
        indexer_head_dim=_int(cfg, "index_head_dim", where, 0) if "indexed_attention" in types else 0,
        attention_output_gate=model_type in ("qwen3_next", "qwen3_5_moe_text") or bool(cfg.get("attn_output_gate", False)),
        mlp_gated=not single_block,
        single_block=single_block,
        vision_params=vision_params,
        estimated=tuple(estimated),
        expert_format=stored,
        checkpoint_expert_format=stored,
    )


def _checkpoint_expert_format(quant: Any, where: str) -> str:
    """"mxfp4" | "fp8" for the quantized releases the engine loads as stored, "" for float checkpoints."""
    if not isinstance(quant, Mapping):
        return ""
    method = quant.get("quant_method")
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ModelError(f"{where}: FP8 weight_block_size {block!r} is not supported; expected [128, 128]")
        return "fp8"
    raise ModelError(f"{where}: quantization_config.quant_method {method!r} is not supported; expected mxfp4 or fp8 "
                     "(gpt-oss MXFP4, DeepSeek-style block FP8) or an unquantized checkpoint")
