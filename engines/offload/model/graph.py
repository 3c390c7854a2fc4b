"""The owned model graph: one forward for every paged step, built from the model description out of shared blocks.

    ModelGraph.build(model, executor, desc) --per layer, the description's kinds--> blocks.py
      AttentionBlock (q/k/v, q/k norms, rotary, paged KV, window, sinks) | MoEBlock (router -> executor, shared
      expert) | a MoE block's selection (moe_blocks.RouterBlock) | MLPBlock
    forward(ids [N], pos [N], step, keep [R]):  any mix of prefill chunks, decode rows and draft rows
      embed -> rotary tables (one per rotary kind and table) ->
      per layer: h += attention(norm(h)); h += ffn(norm(h))   -> final norm of the kept rows -> head -> logits [R, V]

The step's layout (kv.StepContext: where each new KV row goes, which rows each sequence reads) is passed to every
attention block, never found on the thread. Decode-only steps of bf16 models take the fused C++ call instead
(fastpath.py: the same computation in few calls); everything else runs here. transformers is where the weights
are found (the modules' parameters, by name) and computes the rotary tables (its rotary module knows every rope
scaling); no transformers module runs a layer, except a MoE block whose router the description cannot express
(``runs_as_module``), which runs as its module.

Tensor-parallel ranks (ranks/parallel.py) run it where the fused decode path keeps attention whole on every rank:
the executor sums each MoE layer's rows over the ranks, a rank's LM head (VocabShard) gathers the vocabulary.

Gated-DeltaNet layers (Qwen3-Next) run as deltanet.DeltaNetBlock: the kernel for decode rows, the module's own
chunked rule for prefill chunks. Not yet here (their models run transformers' modules, the reason logged once;
test_graph.py lists them): MLA with a sparse indexer (DeepSeek-V3.2), ranks that split attention heads (dense_split.py).

On every device: the blocks are torch ops on the step's rows, and the few kernels they call (kernels/ops.py:
grouped_topk, gemm_bf16, a shared expert's rows, the MLA and DeltaNet decode, the tiled prefill attention) compute in
torch where the compiled CPU kernels do not run (ops.native: a CUDA tensor, or the kernels off), so a CUDA engine's
steps run this graph, its executor's slot hits and fetches as on the module path.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from moe_offload.control.description import Attention, ModelDescription, router_in_layer_call
from moe_offload.control.description import MoEBlock as MoEDesc
from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.kernels.dispatch import bound
from moe_offload.engines.offload.loading.quant import RowsLinear
from moe_offload.engines.offload.model import blocks, mla
from moe_offload.engines.offload.model.deltanet import DeltaNetBlock
from moe_offload.engines.offload.model.fused_bind import cos_sin
from moe_offload.engines.offload.model.moe_blocks import block_for
from moe_offload.engines.offload.model.weights import FFN_NAMES, decoder, ffn_of, is_silu, shared_expert_of
from moe_offload.engines.offload.runtime import kv
from moe_offload.log import get_logger

log = get_logger("moe_offload.graph")

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_LINEAR_PARTS = {"linear_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_BESIDE = "shared_mlp"  # a shared MLP beside the MoE block (GraniteMoeShared), checked against the description by _layer


@dataclass
class _Layer:
    norms: tuple  # (input norm, post-attention norm) modules: their weight and eps
    attention: blocks.AttentionBlock | blocks.MLABlock | DeltaNetBlock
    rotary: object  # description.Rotary, or None (NoPE)
    ffn: object  # rows [N, H] -> [N, H]
    moe: object = None  # the routed block in parts (route, the executor, finish): blocks.MoEBlock | RouterBlock


class ModelGraph:
    """Built once per engine by ``build``; ``forward`` runs one step of any shape over the paged KV cache."""

    def __init__(self, model, executor, desc: ModelDescription, layers: list[_Layer], cache: kv.PagedCache):
        inner = decoder(model)
        self.model, self.embed, self.rotary_emb, self.norm = model, inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = bound(model.lm_head)  # a rank's VocabShard: itself
        self.executor, self.desc, self.layers, self.cache = executor, desc, layers, cache
        self.kind = desc.norm.kind
        self.rotaries = [r for r in dict.fromkeys(lay.rotary for lay in layers) if r is not None]
        scales = {getattr(d.mixer, "query_scale", None) for d in desc.layers}
        assert len(scales) == 1, scales  # one per model (refuse)
        self.query_scale = scales.pop()
        self.steps = 0
        self.keep_hidden = False  # MTP drafts (mtp.py) read every row's final-normed hidden state: ``hidden``
        self.hidden: torch.Tensor | None = None  # [N, H] of the last forward, when keep_hidden

    @classmethod
    def build(cls, model, executor, desc: ModelDescription, cache: kv.PagedCache) -> "ModelGraph | None":
        """The graph for this model, or None (the reason logged) where transformers' modules must run."""
        try:
            why = refuse(model, executor, desc)
            layers = [] if why else [_layer(model, executor, desc, i) for i in range(len(desc.layers))]
        except (AttributeError, TypeError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        if not why and any(isinstance(lay, str) for lay in layers):
            why = next(lay for lay in layers if isinstance(lay, str))
        if executor is not None and executor.ep is not None:  # ranks: every rank takes the graph, or none does
            from moe_offload.engines.offload.ranks.parallel import agree

            if not agree(not why) and not why:
                why = "another rank cannot build the graph"
        if why:
            log.info("owned graph off: steps run transformers' modules", model_type=desc.model_type, reason=why)
            return None
        log.info("owned graph on", model_type=desc.model_type, layers=len(layers))
        return cls(model, executor, desc, layers, cache)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, step: kv.StepContext, keep: torch.Tensor) -> torch.Tensor:
        """ids, pos [N] (the step's tokens and their positions, packed as the step lays them out), ``step`` its KV
        layout, keep [R] the rows whose logits are wanted -> logits [R, V]."""
        ex = self.executor
        t0 = time.perf_counter()
        ex.begin_forward()
        h, rot = self.embed_rows(ids, pos)
        for lay in self.layers:
            h, x2 = self.attention_half(lay, h, rot, step)
            h = self.residual(h, lay.ffn(x2))
        if self.keep_hidden:  # every row's final norm (row-wise: the kept rows' values as head computes them)
            self.hidden = self.final_norm(h)
            logits = self.logits(self.hidden.index_select(0, keep))
        else:
            logits = self.head(h.index_select(0, keep))
        ex.end_forward(t0)
        self.steps += 1
        return logits

    # -- the parts of a step (forward above; capture.py runs them piece by piece) -----------------------------------
    def embed_rows(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The rows' embeddings h [N, H] and the step's rotary tables {rotary: (cos, sin[, query scale])}."""
        h = self.embed(ids)  # [N, H]
        if self.desc.scales.embedding != 1.0:
            h = h * self.desc.scales.embedding
        return h, self.rotary_tables(h, pos)

    def rotary_tables(self, h: torch.Tensor, pos: torch.Tensor) -> dict:
        """{rotary: (cos, sin[, query scale])} at positions pos [N] (h: the rows, for their dtype and device)."""
        rot, qs = {}, ()
        if self.query_scale is not None:  # the step's position tables carry Llama 4's query scale [N] (fp32) too
            beta, orig = self.query_scale
            qs = (1 + beta * torch.log(1 + torch.floor(pos / orig)),)
        for r in self.rotaries:
            cos, sin = cos_sin(self.rotary_emb, h.unsqueeze(0), pos.unsqueeze(0), r, raw=True)  # [1, N, D']
            rot[r] = (cos[0].unsqueeze(1), sin[0].unsqueeze(1), *qs)  # [N, 1, D']: every head
        return rot

    def attention_half(self, lay: _Layer, h: torch.Tensor, rot: dict, step: kv.StepContext
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer up to its feed-forward part: (h after the token mixer's residual, its second norm's rows)."""
        n1, n2 = lay.norms
        a = lay.attention(blocks.rms_norm(h, n1.weight, blocks.eps_of(n1), self.kind), rot.get(lay.rotary), step,
                          self.cache)
        h = self.residual(h, a)
        return h, blocks.rms_norm(h, n2.weight, blocks.eps_of(n2), self.kind)

    def residual(self, h: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        res = self.desc.scales.residual
        return h + (branch if res == 1.0 else branch * res)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head of the kept rows h [R, H] -> logits [R, V]."""
        return self.logits(self.final_norm(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return blocks.rms_norm(h, self.norm.weight, blocks.eps_of(self.norm), self.kind)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head of final-normed rows x [R, H] -> logits [R, V]."""
        logits = self.lm_head(x)  # [R, V] (a rank's VocabShard gathers every rank's rows)
        return logits / self.desc.scales.logits if self.desc.scales.logits != 1.0 else logits


def refuse(model, executor, desc: ModelDescription) -> str:
    """Why the graph cannot run this model ("" when it can): the parts its blocks lack, or a module layout that does
    not hold what the description says."""
    if desc.path != "fused":
        return desc.why
    if desc.attention not in ("gqa", "mla"):
        return "no softmax attention: the graph has no block for it yet"
    if len({getattr(d.mixer, "query_scale", None) for d in desc.layers}) > 1:
        return "a query scale on some layers only"
    if desc.linear and desc.linear != "gated_deltanet":
        return f"{desc.linear} layers: the graph has no block for them yet"
    if executor is None:
        return "no offload executor"
    cfg = model.config.get_text_config()  # a wrapper's text decoder's
    if getattr(cfg, "clip_qkv", None) is not None:
        return "clip_qkv"
    inner = decoder(model)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
        return "unexpected module layout"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "an embedding other than a plain lookup"
    head = getattr(model, "lm_head", None)
    if not isinstance(getattr(head, "part", head), (torch.nn.Linear, RowsLinear)):  # a rank's rows: VocabShard
        return "no linear LM head"
    if len(inner.layers) != len(desc.layers):
        return f"{len(inner.layers)} layers, the description has {len(desc.layers)}"
    for i, layer in enumerate(inner.layers):
        parts = {"mlp" if n in FFN_NAMES else n for n, m in layer.named_children()
                 if not isinstance(m, torch.nn.Dropout) and n != _BESIDE}
        mixer = desc.layers[i].mixer
        want = _LAYER_PARTS if isinstance(mixer, Attention) else _LINEAR_PARTS
        if parts != want:
            return f"layer {i}: parts {sorted(parts - want) or sorted(want - parts)} beyond a norm-mixer-norm-ffn layer"
        if not isinstance(mixer, Attention):
            continue  # a gated-DeltaNet layer: deltanet.DeltaNetBlock
        if mixer.query_scale is not None and mixer.kind != "mla":
            return f"layer {i}: a query scale on an attention other than MLA"
        if mixer.kind == "mla":
            if not mla.eligible(layer.self_attn):
                return f"layer {i}: an MLA attention of another kind (a sparse indexer, a window)"
            continue
        attn = layer.self_attn
        if (blocks.qk_norms(attn)[0] is not None) != bool(mixer.qk_norm) or (
                getattr(attn, "sinks", None) is not None) != mixer.sinks:
            return f"layer {i}: q/k norms or sinks the description does not name"
    return ""


def _layer(model, executor, desc: ModelDescription, i: int) -> _Layer | str:
    layer, d = decoder(model).layers[i], desc.layers[i]
    if not isinstance(d.mixer, Attention):
        if not isinstance(layer.linear_attn.__dict__.get("forward"), functools.partial):
            return f"layer {i}: a gated-DeltaNet layer without the engine's forward (deltanet.install)"
        attn = DeltaNetBlock(layer.linear_attn)
        dispatch.patch_linears(layer.linear_attn)  # its prefill chunks run the module: its linears as the fallback's
    elif d.mixer.kind == "mla":
        attn = blocks.MLABlock(layer.self_attn, d.mixer, i, desc.norm.kind)
    else:
        attn = blocks.AttentionBlock(layer.self_attn, d.mixer, i, desc.norm.kind)
    mlp = ffn_of(layer)
    moe = None
    if not isinstance(d.ffn, MoEDesc):
        ffn = blocks.MLP(mlp)
    else:
        experts = getattr(mlp, "experts", None)
        if getattr(experts, "_moe_offload", None) is None:
            return f"layer {i}: experts not served by the executor"
        r = d.ffn.router
        beside = getattr(layer, _BESIDE, None)  # GraniteMoeShared: a shared MLP beside the block, the same input
        if (beside is not None) != (d.ffn.shared_experts > 0 and not hasattr(mlp, "shared_experts")
                                    and not hasattr(mlp, "shared_expert")):
            return f"layer {i}: the description and the modules disagree on a shared MLP beside the MoE block"
        if beside is not None and not is_silu(beside.activation):
            return f"layer {i}: a shared MLP of another activation"
        if d.ffn.runs_as_module:  # the block runs as its module: its linears on the kernels as the fallback's
            dispatch.patch_linears(mlp)
        if beside is not None and d.ffn.runs_as_module:
            ffn = lambda x, m=mlp, s=blocks.ChunkedMLP(beside): _module_rows(m, x) + s(x)  # noqa: E731
        elif d.ffn.runs_as_module:  # a router the description cannot express: the block's module (experts offloaded)
            ffn = lambda x, m=mlp: _module_rows(m, x)  # noqa: E731
        elif router_in_layer_call(d.ffn):  # a softmax router of model-dtype logits (the fused call's kind)
            gate = mlp.router if hasattr(mlp, "router") else mlp.gate
            shared = shared_expert_of(layer, mlp)
            if (shared is None) != (d.ffn.shared_experts == 0 and not d.ffn.shared_gate):
                return f"layer {i}: the description and the modules disagree on a shared expert"
            ffn = moe = blocks.MoEBlock(executor, experts, blocks.SoftmaxRouter(gate, r), shared,
                                        getattr(mlp, "shared_expert_gate", None) if d.ffn.shared_gate else None)
        else:
            moe = block_for(mlp, d.ffn)
            if moe is None:
                return f"layer {i}: a router the selection call does not take"
            ffn = lambda x, b=moe: b(executor, x)  # noqa: E731
    return _Layer((layer.input_layernorm, layer.post_attention_layernorm), attn, getattr(d.mixer, "rotary", None), ffn,
                  moe)


def _module_rows(module, x: torch.Tensor) -> torch.Tensor:
    """A block run as its module on the rows x [N, H] (it takes [1, N, H]; some return (out, router scores))."""
    out = module(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0]
