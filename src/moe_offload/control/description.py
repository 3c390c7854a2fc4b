"""One model description, built once from a config: what each decoder layer computes, in named parts.

    config.json --hf_config.parse--> ModelSpec (sizes, layer kinds, which layers are MoE)
                --families.FAMILIES[model_type] (the parts the family is made of)--> describe()
      --> ModelDescription
            path: fused (every layer a kind the whole-step executor computes) | module (transformers' modules)
            norm: Norm (the final norm; every layer's norms are of the same kind)
            scales: Scales (the embedding, residual and logits multipliers; Granite's, else 1)
            layers[i]: mixer    Attention (gqa | mla; window, sinks, output gate, q/k norm, biases, rotary or NoPE)
                              | LinearMixer (gated_deltanet)
                       ffn      MoEBlock (Router: scoring, order, bias, groups, top-k, renormalise, scale, dtypes;
                                          shared experts and their gate, expert biases, activation) | DenseMLP

Nothing here reads a module or its source: the registry says what a family is, the config says how big and
which layer is which. tests/engines/offload/test_family_registry.py checks the registry against the installed
transformers, and the fused path's exactness tests check each description against the modules it replaces.
Every value is a name or a number; no integer modes (kernels/ops.py turns the names into the kernels' codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

NormKind = Literal["rms", "rms_fp32_scale", "rms_one_plus"]
# rms: bf16(w * bf16(x / rms)); rms_fp32_scale: bf16(w * (x / rms)) (gpt-oss scales in fp32);
# rms_one_plus: zero-centred weights, bf16((1 + w) * (x / rms)) in fp32 (Qwen3-Next)
RotaryKind = Literal["rotate_half", "halves", "partial", "interleaved_fp32", "complex_fp32"]
# rotate_half over the whole head; halves: cos/sin of D/2 over the two halves (gpt-oss); partial: rotate_half over
# the first dims, the rest passes (partial_rotary_factor); interleaved_fp32: pairs (2j, 2j+1) in fp32 (Ernie 4.5);
# complex_fp32: pairs (2j, 2j+1) times the module's complex table in fp32, left interleaved (DeepSeek-V2's MLA)
RouterScoring = Literal["softmax", "sigmoid"]
RouterOrder = Literal["score_then_topk", "topk_then_score"]
Activation = Literal["silu", "clamped_swiglu"]


@dataclass(frozen=True)
class Norm:
    kind: NormKind
    eps: float


@dataclass(frozen=True)
class Rotary:
    """How a layer rotates q and k. ``table``: the rotary module's per-layer-type table (a ``layer_types`` name)
    where the family keeps one per type, else None (its one table)."""

    kind: RotaryKind
    table: str | None = None


@dataclass(frozen=True)
class Attention:
    kind: Literal["gqa", "mla"]
    rotary: Rotary | None  # None: no position encoding on this layer (NoPE)
    window: int | None = None  # sliding window in keys; None: every key
    sinks: bool = False  # a learned per-head logit beside the keys (gpt-oss)
    output_gate: bool = False  # q_proj also yields a sigmoid gate on the output (Qwen3-Next)
    # RMSNorm of q and k per head or over the projection, before the rotary; head_after_rotary: per head, after it
    qk_norm: Literal["", "head", "full", "head_after_rotary"] = ""
    qkv_bias: bool = False
    o_bias: bool = False
    # Llama 4's query scale (Mistral 4): q times 1 + beta * log(1 + floor(position / original)), as (beta, original)
    query_scale: tuple[float, int] | None = None


@dataclass(frozen=True)
class LinearMixer:
    kind: Literal["gated_deltanet"]


@dataclass(frozen=True)
class Router:
    scoring: RouterScoring
    order: RouterOrder  # softmax over every expert then top-k, or top-k logits then softmax over them
    top_k: int
    renormalise: bool  # the chosen weights over their sum
    correction_bias: bool = False  # a bias added to the scores to choose, not to weigh (DeepSeek-V3)
    groups: tuple[int, int] | None = None  # (groups, groups kept): choose within the best groups
    scale: float = 1.0  # routed_scaling_factor
    logits_bias: bool = False  # the router linear has a bias (gpt-oss)
    weights_dtype: Literal["model", "fp32"] = "model"  # the top-k weights rounded to the model dtype, or kept fp32
    logits_dtype: Literal["model", "fp32"] = "model"  # the router GEMV in the model dtype or in fp32


@dataclass(frozen=True)
class MoEBlock:
    router: Router
    experts: int
    shared_experts: int = 0
    shared_gate: bool = False  # a sigmoid Linear(H, 1) on the shared expert's output (Qwen2-MoE)
    expert_biases: bool = False
    activation: Activation = "silu"
    runs_as_module: bool = False  # the block's glue is a kind not described: its module runs (experts still offloaded)


@dataclass(frozen=True)
class DenseMLP:
    activation: Literal["silu"] = "silu"


@dataclass(frozen=True)
class Scales:
    """Multipliers around the layers (Granite): the embedding's rows times ``embedding``, each sub-layer's output
    times ``residual`` before it joins the residual, the logits divided by ``logits``."""

    embedding: float = 1.0
    residual: float = 1.0
    logits: float = 1.0


@dataclass(frozen=True)
class Layer:
    index: int
    mixer: Attention | LinearMixer
    ffn: MoEBlock | DenseMLP


@dataclass(frozen=True)
class ModelDescription:
    model_type: str
    path: Literal["fused", "module"]
    why: str  # why the module path, in words ("" on the fused path)
    norm: Norm | None
    layers: tuple[Layer, ...]
    linear: str = ""  # the family's linear-attention kind (gated_deltanet: its kernel runs on either path), else ""
    scales: Scales = Scales()

    @property
    def attention(self) -> str:
        """gqa | mla | "" (no softmax-attention layer): the kind of the model's softmax attention."""
        return next((lay.mixer.kind for lay in self.layers if isinstance(lay.mixer, Attention)), "")

    @property
    def uniform_rotary(self) -> bool:
        """Every attention layer rotates with the same table (one cos/sin per step serves them all)."""
        return len({lay.mixer.rotary for lay in self.layers if isinstance(lay.mixer, Attention)}) <= 1


def fused_refusal(desc: ModelDescription) -> str:
    """Why the fused decode call cannot take a model of this description ("" when it may): the parts it lacks, known
    from the description alone (engines/offload/model/fused_bind.py checks the modules and dtypes besides). Such a
    model's decode steps run the owned graph."""
    if desc.path != "fused":
        return desc.why
    if desc.scales != Scales() and desc.attention == "mla":
        return "embedding, residual or logits multipliers on MLA layers: the fused MLA call has none (the graph decodes)"
    mixers = [lay.mixer for lay in desc.layers if isinstance(lay.mixer, Attention)]
    if any(m.query_scale for m in mixers):
        return "a position-dependent query scale (Llama 4's): the fused MLA call has none (the graph decodes)"
    if any(m.qk_norm == "head_after_rotary" for m in mixers):
        return "q/k norms after the rotary: the fused call norms before it (the graph decodes)"
    return ""


def router_in_layer_call(block: MoEBlock) -> bool:
    """The fused layer call computes this block's router itself: softmax scores (over every expert, or over the top-k
    logits) of model-dtype logits without a correction bias or a scale; other routers are a MoE block's selection
    (moe_blocks.block_for)."""
    r = block.router
    return (not block.runs_as_module and r.scoring == "softmax" and not r.correction_bias and r.groups is None
            and r.scale == 1.0 and r.logits_dtype == "model")


def describe(config: Mapping[str, Any] | Any, name: str | None = None) -> ModelDescription:
    """The description of a config (a config.json dict or a transformers config). A family the registry does not
    list, or one registered as module-only, describes as the module path with the reason."""
    from moe_offload.control import families
    from moe_offload.control.hf_config import parse, text_config

    raw = config if isinstance(config, Mapping) else config.to_dict()
    f = parse(dict(raw), name)
    text, _ = text_config(dict(raw))
    # the registry names the checkpoint's model_type (a multimodal wrapper's, not its text config's)
    model_type = str(raw.get("model_type") or f["model_type"])
    fam = families.FAMILIES.get(model_type) or families.FAMILIES.get(f["model_type"])
    if fam is None:
        return ModelDescription(model_type, "module", "family not in the registry", None, ())
    if fam.attention == "module":
        return ModelDescription(model_type, "module", fam.why or "registered for the module path", None, (),
                                fam.linear)
    eps = float(text.get("rms_norm_eps") or text.get("layer_norm_epsilon") or 1e-6)
    types = tuple(f.get("layer_types") or ())
    moe = set(f["moe_layers"])
    layers = []
    for i in range(f["num_layers"]):
        kind = types[i] if i < len(types) else "full_attention"
        if kind == "linear_attention":
            if not fam.linear:
                return ModelDescription(model_type, "module", f"layer {i}: linear attention the family does not name",
                                        None, ())
            mixer: Attention | LinearMixer = LinearMixer(fam.linear)
        elif kind in ("full_attention", "sliding_attention"):
            mixer = _attention(fam, f, text, kind)
        else:
            return ModelDescription(model_type, "module", f"layer {i}: a {kind} layer", None, (), fam.linear)
        ffn = _moe_block(fam, f, text) if i in moe else DenseMLP()
        layers.append(Layer(i, mixer, ffn))
    if fam.query_scale == "llama4" and not all(
            k in (text.get("rope_parameters") or {}) for k in ("llama_4_scaling_beta", "original_max_position_embeddings")):
        return ModelDescription(model_type, "module", "rope_parameters lacks llama_4_scaling_beta or "
                                "original_max_position_embeddings (the query scale)", None, ())
    scales = Scales()
    if fam.multipliers == "config":
        scales = Scales(*(float(text.get(k, 1.0) or 1.0) for k in ("embedding_multiplier", "residual_multiplier",
                                                                    "logits_scaling")))
    return ModelDescription(model_type, "fused", "", Norm(fam.norm, eps), tuple(layers), fam.linear, scales)


def _attention(fam, f: Mapping[str, Any], text: Mapping[str, Any], kind: str) -> Attention:
    window = f.get("sliding_window") or None
    if fam.window == "layer_types" and kind != "sliding_attention":
        window = None
    rotary = Rotary(fam.rotary, kind if fam.rotary_tables == "per_layer_type" else None)
    if fam.rotary_on == "sliding_layers" and window is None and f.get("sliding_window"):
        rotary = None  # global layers of a hybrid-window model carry no position encoding
    query_scale = None
    if fam.query_scale == "llama4":
        rope = text.get("rope_parameters") or {}
        query_scale = (float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"]))
    return Attention(fam.attention, rotary, window=window, sinks=bool(f.get("attention_sinks")),
                     output_gate=bool(f.get("attention_output_gate")), qk_norm=fam.qk_norm or f.get("qk_norm") or "",
                     qkv_bias=bool(f.get("qkv_bias")), o_bias=bool(f.get("o_bias")), query_scale=query_scale)


def _moe_block(fam, f: Mapping[str, Any], text: Mapping[str, Any]) -> MoEBlock:
    r = fam.router
    groups = None
    if r == "grouped_sigmoid":
        groups = (int(text.get("n_group") or 1), int(text.get("topk_group") or 1))
    renorm = fam.renormalise == "always" or (fam.renormalise == "config" and bool(text.get("norm_topk_prob")))
    if r in ("sigmoid_topk", "softmax_bias"):
        renorm = True
    greedy = r == "softmax_greedy"
    if greedy:
        renorm = False
    router = Router(
        scoring="sigmoid" if r in ("grouped_sigmoid", "sigmoid_topk") else "softmax",
        order="topk_then_score" if r == "topk_softmax" else "score_then_topk",
        top_k=int(f["top_k"]), renormalise=renorm,
        correction_bias=r in ("grouped_sigmoid", "sigmoid_topk", "softmax_bias"), groups=groups,
        scale=float(text.get("routed_scaling_factor") or 1.0) if r in ("grouped_sigmoid", "softmax_greedy") else 1.0,
        logits_bias=bool(f.get("router_bias")),
        weights_dtype=fam.router_weights,
        logits_dtype="fp32" if r in ("grouped_sigmoid", "softmax_bias", "softmax_greedy") else "model")
    # DeepSeek-V2's group_limited_greedy (a group's score its best expert's) is not described: the block's module runs
    limited = greedy and str(text.get("topk_method") or "greedy") != "greedy"
    return MoEBlock(router, int(f["num_experts"]), int(f.get("num_shared_experts") or 0),
                    bool(f.get("shared_expert_gate")), bool(f.get("expert_bias")), fam.activation,
                    runs_as_module=r == "module" or limited)
