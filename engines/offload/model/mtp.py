"""MTP drafts: the multi-token-prediction layer DeepSeek-V3 / R1, Kimi K2 and GLM-4.5+ checkpoints ship beside their
decoder (``num_nextn_predict_layers``; its weights under ``model.layers.<num_hidden_layers>.``, which transformers
does not load), run on the owned graph's blocks as a speculative method (``--speculative-config '{"method": "mtp"}'``).

    a step of the target (graph.forward, every row's final-normed hidden state h_p kept: ModelGraph.keep_hidden)
      -> its tokens are known (output.py: sampled, or accepted by verification)
      -> the MTP layer over the same rows, positions and KV layout (its KV in the pool as layer N = num_hidden_layers),
         each row p taking the token after it, t_{p+1} (the prompt's next, or the step's sampled / accepted one; a
         rejected draft's row takes any: its KV lies beyond the sequence and is rewritten when that position is):
           x = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])          (embed(t) zero at position 0, as vLLM's)
           -> the decoder layer's blocks (graph.attention_half, the MoE block's router, its own routed experts)
           -> shared_head: norm, head
      -> the row at a sequence's last computed position: its argmax is the draft of the sequence's next step (k = 1)

The verify step keeps what the target agrees with (speculative.py), so the output is the plain run's token for token
whatever the drafts; the drafts are what the checkpoint trained its MTP layer to predict.

Not here: a second MTP layer (chained drafts, k > 1), tensor-parallel ranks, linear-attention models (Qwen3-Next's
MTP: a rejected draft cannot be rolled out of its recurrent state, speculative.py refuses those), checkpoints whose
MTP layer is quantized other than FP8 blocks. The MTP layer's routed experts stay where the dense weights are (the
accelerator) and are computed in torch: they are not offloaded tiers.
Legend: N rows of the step, H hidden, V vocabulary, E experts, I an expert's intermediate size, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_offload.control.description import Attention, ModelDescription, router_in_layer_call
from moe_offload.control.description import MoEBlock as MoEDesc
from moe_offload.engines.offload.experts.executor import by_expert, weighted_sum
from moe_offload.engines.offload.kernels import dispatch, ops
from moe_offload.engines.offload.model import blocks
from moe_offload.engines.offload.model.moe_blocks import selection
from moe_offload.engines.offload.model.weights import decoder
from moe_offload.engines.offload.runtime.scheduler import FINISHED
from moe_offload.errors import ConfigError

_EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight")  # the MTP layer's own tensors; the rest is a decoder layer's


@dataclass
class MTPWeights:
    """The first MTP layer of a checkpoint: a decoder layer module (its experts' weights stacked [E, 2I, H] /
    [E, H, I] on its experts module, as transformers' fused layout) and the MTP tensors around it."""

    layer: torch.nn.Module
    index: int  # its layer index: num_hidden_layers (the pool's layer for its KV)
    extra: dict  # _EXTRAS name -> tensor (embed_tokens / shared_head.head absent: the target's are used)


def weights_for(speculative, offloaded) -> MTPWeights | None:
    """The MTP layer build_offload_engine loaded for ``speculative`` method mtp (else None), checked against what the
    engine runs."""
    if speculative is None or speculative.method != "mtp":
        return None
    weights = getattr(offloaded, "mtp", None)
    if weights is None:
        raise ConfigError("speculative method mtp: no MTP layer loaded with the model (build_offload_engine reads it "
                          "from the checkpoint)")
    if getattr(offloaded.executor, "ep", None) is not None:
        raise ConfigError("speculative method mtp: not over tensor-parallel ranks yet")
    return weights


def attach(runner, weights: MTPWeights, desc: ModelDescription) -> "Drafter":
    """The engine's drafter over ``runner``'s owned graph: the graph and the fused decode call keep the hidden rows
    the MTP layer reads; captured CUDA steps do not hand them back, so decode there runs the graph eagerly."""
    if runner.graph is None:
        raise ConfigError("speculative method mtp: its drafts run on the owned graph, and this model's steps run "
                          "transformers' modules (the log's 'owned graph off' says why)")
    runner.capture = None
    runner.graph.keep_hidden = True
    if runner.fast is not None:
        runner.fast.keep_hidden = True
    return Drafter(weights, runner.graph, desc)


def load(path: str, model, device: torch.device) -> MTPWeights:
    """The checkpoint's first MTP layer for ``model`` (its target, loaded), on ``device`` in the model's dtype.
    ConfigError where the checkpoint has none, or in a form not read here."""
    from moe_offload.engines.offload.loading import checkpoint, quant

    cfg = model.config.get_text_config()
    n, N = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0), int(cfg.num_hidden_layers)
    prefix = f"model.layers.{N}."
    method = checkpoint.quant_method(model.config, str(path))
    if method not in (None, "fp8"):
        raise ConfigError(f"speculative method mtp: a {method} checkpoint's MTP layer is not read yet (float and FP8 "
                          "block checkpoints are)")
    inner = decoder(model)
    last = inner.layers[-1]
    dtype = inner.embed_tokens.weight.dtype
    with checkpoint.Files(Path(path)) as files:
        keys = [k for k in files.keys() if k.startswith(prefix)]
        if n < 1 or not keys:
            raise ConfigError(f"speculative method mtp: {path} ships no MTP layer (num_nextn_predict_layers "
                              f"{n}, no tensors under {prefix}*)")
        sd = {}
        for k in keys:
            if method == "fp8" and k.endswith(checkpoint.SCALE_SUFFIX):
                continue
            t = files.tensor(k)
            if method == "fp8" and k + checkpoint.SCALE_SUFFIX in files:
                t = quant.dequantize_fp8(t, files.tensor(k + checkpoint.SCALE_SUFFIX).float(), 0, dtype)
            sd[k[len(prefix):]] = t
    extra = {k: sd.pop(k).to(device, dtype) for k in _EXTRAS if k in sd}
    missing = [k for k in _EXTRAS[:5] if k not in extra and k != "shared_head.head.weight"]
    if missing:
        raise ConfigError(f"speculative method mtp: the MTP layer lacks {', '.join(prefix + k for k in missing)}")
    with torch.device("meta"):
        layer = type(last)(cfg, N)
    want = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}  # the names a decoder layer holds
    stored = {**dict(last.named_parameters()), **dict(last.named_buffers())}  # their dtypes in the target (not experts)
    _stack_experts(layer, sd)
    unknown = sorted(set(sd) - set(want))
    if unknown:
        raise ConfigError(f"speculative method mtp: tensors the decoder layer does not hold: {prefix}{unknown[0]}")
    gaps = sorted(set(want) - set(sd))
    if gaps:
        raise ConfigError(f"speculative method mtp: the MTP layer lacks {prefix}{gaps[0]}")
    sd = {k: v.to(device, stored[k].dtype if k in stored else dtype) for k, v in sd.items()}
    layer.load_state_dict(sd, strict=True, assign=True)
    return MTPWeights(layer.eval(), N, extra)


def _stack_experts(layer, sd: dict) -> None:
    """The checkpoint's per-expert gate/up/down linears (``mlp.experts.<e>.<proj>.weight``) -> the experts module's
    fused parameters (``gate_up_proj`` [E, 2I, H]: gate rows then up rows, ``down_proj`` [E, H, I]), in ``sd``."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    E = int(getattr(experts, "num_experts", 0) or 0)
    if not E or not hasattr(experts, "gate_up_proj"):
        return
    gate = [sd.pop(f"mlp.experts.{e}.gate_proj.weight", None) for e in range(E)]
    up = [sd.pop(f"mlp.experts.{e}.up_proj.weight", None) for e in range(E)]
    down = [sd.pop(f"mlp.experts.{e}.down_proj.weight", None) for e in range(E)]
    if any(t is None for t in gate + up + down):
        raise ConfigError(f"speculative method mtp: the MTP layer's experts are not {E} per-expert gate/up/down "
                          "linears")
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    sd["mlp.experts.down_proj"] = torch.stack(down)


def kv_bytes(total: int, desc: ModelDescription) -> int:
    """The MTP layer's KV bytes per token, from the target's ``total`` over its layers (every one attention, the
    MTP layer one more of the same kind)."""
    return -(-total // len(desc.layers))


def routed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """The routed experts' rows for x [N, H], ids / weights [N, K]: per expert hit silu(gate) * up -> down, times
    the pair's weight, summed into the rows in x's dtype: bf16 on the CPU in one moe_experts_bf16 call and the
    executor's combine, else per expert hit (in order) as transformers' experts loop computes."""
    K = ids.shape[1]
    groups, perm = by_expert(ids)  # the executor's grouping: (expert, start, count) into perm
    if x.dtype == gate_up.dtype == torch.bfloat16 and ops.native(x):  # one fused-experts call
        proj = ops.experts(x.contiguous(), [gate_up[e] for e, _, _ in groups], [down[e] for e, _, _ in groups],
                           perm // K, perm, [s for _, s, _ in groups], [n for _, _, n in groups],
                           x.new_empty((perm.numel(), x.shape[1])))
        return weighted_sum(proj, weights, x.dtype)
    out = torch.zeros_like(x)
    for e, start, n in groups:
        pairs = perm[start : start + n]
        rows, k = pairs // K, pairs % K
        gate, up = dispatch.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        h = dispatch.linear(F.silu(gate) * up, down[e]) * weights[rows, k, None]
        out.index_add_(0, rows, h.to(out.dtype))
    return out


class _Softmax:
    """A softmax router without a shared expert (Qwen3-MoE's) in RouterBlock's route / finish form."""

    def __init__(self, router: blocks.SoftmaxRouter):
        self.router = router

    def route(self, x: torch.Tensor):
        return (*self.router(x), x)

    def finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out


class Drafter:
    """The speculative proposer of method mtp (make_proposer's interface: propose, release), and the step that
    computes its drafts (``after``, the engine's, once a step's tokens are known)."""

    def __init__(self, weights: MTPWeights, graph, desc: ModelDescription):
        from moe_offload.engines.offload.model.graph import _Layer

        d, layer = desc.layers[-1], weights.layer
        if not isinstance(d.mixer, Attention) or not isinstance(d.ffn, MoEDesc) or d.ffn.runs_as_module:
            raise ConfigError("speculative method mtp: its layer is a softmax-attention MoE layer the graph runs; "
                              f"{desc.model_type}'s last layer is not")
        if d.ffn.activation != "silu" or d.ffn.expert_biases:
            raise ConfigError(f"speculative method mtp: experts of activation {d.ffn.activation} (biases "
                              f"{d.ffn.expert_biases}); the MTP layer computes silu experts")
        mixer = d.mixer
        attn = (blocks.MLABlock if mixer.kind == "mla" else blocks.AttentionBlock)(
            layer.self_attn, mixer, weights.index, desc.norm.kind)
        mlp = layer.mlp
        if router_in_layer_call(d.ffn) and not hasattr(mlp, "shared_experts") and not hasattr(mlp, "shared_expert"):
            gate = mlp.router if hasattr(mlp, "router") else mlp.gate
            self.router = _Softmax(blocks.SoftmaxRouter(gate, d.ffn.router))
        else:
            self.router = selection(mlp, d.ffn, None)
        if self.router is None:
            raise ConfigError(f"speculative method mtp: a router the selection call does not take ({desc.model_type})")
        self.layer = _Layer((layer.input_layernorm, layer.post_attention_layernorm), attn,
                            getattr(mixer, "rotary", None), self._moe)
        self.graph, self.weights, self.kind = graph, weights, desc.norm.kind
        w = weights.extra
        self.embed = w.get("embed_tokens.weight", graph.embed.weight)
        self.head = w.get("shared_head.head.weight", graph.model.lm_head.weight)
        self.eps = float(graph.model.config.get_text_config().rms_norm_eps)
        self.drafts: dict[int, tuple[int, int]] = {}  # sid -> (the sequence's length it drafts after, the token)

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.weights.layer.mlp.experts
        ids, weights, x = self.router.route(x)
        return self.router.finish(x, routed(x, ids, weights, ex.gate_up_proj, ex.down_proj))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return blocks.rms_norm(x, self.weights.extra[name], self.eps, self.kind)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor, step, rows: torch.Tensor
                ) -> torch.Tensor:
        """The MTP layer over a step's rows: ids [N] the token after each row, pos [N], hidden [N, H] the target's
        final-normed rows, ``step`` the target step's KV layout; the logits [R, V] of ``rows`` [R]."""
        g = self.graph
        e = F.embedding(ids, self.embed).masked_fill((pos == 0).unsqueeze(1), 0.0)
        x = dispatch.linear(torch.cat([self._norm("enorm.weight", e), self._norm("hnorm.weight", hidden)], dim=-1),
                            self.weights.extra["eh_proj.weight"])
        h, x2 = g.attention_half(self.layer, x, g.rotary_tables(x, pos), step)
        h = g.residual(h, self._moe(x2)).index_select(0, rows)
        return dispatch.linear(self._norm("shared_head.norm.weight", h), self.head)

    def after(self, last) -> None:
        """A step's MTP rows once its tokens are known: ``last`` the runner's record of the step (ids, pos tensors,
        its StepContext, [(seq, first row, rows, computed before)], the final norm's rows). Every row runs (its KV is
        the MTP layer's past for later positions); each sequence whose last computed position lies in the step gets
        its next draft."""
        pos, step, seqs = last[1], last[2], last[3]
        nxt, want, sids = [], [], []
        for seq, q0, n, c in seqs:
            toks = seq.tokens
            nxt += [toks[p + 1] if p + 1 < len(toks) else 0 for p in range(c, c + n)]
            r = len(toks) - 2 - c  # the row at the last computed position: its next token is the last one
            if 0 <= r < n and seq.state != FINISHED:
                want.append(q0 + r)
                sids.append((seq.sid, len(toks)))
        dev = pos.device
        logits = self.forward(torch.tensor(nxt, device=dev), pos, last[4], step,
                              torch.tensor(want, device=dev, dtype=torch.long))
        for (sid, length), t in zip(sids, logits.argmax(dim=-1).tolist()):
            self.drafts[sid] = (length, t)

    def propose(self, sid: int, tokens: list[int], k: int) -> list[int]:
        d = self.drafts.get(sid)
        return [d[1]] if d is not None and d[0] == len(tokens) and k >= 1 else []

    def release(self, sid: int) -> None:
        self.drafts.pop(sid, None)
