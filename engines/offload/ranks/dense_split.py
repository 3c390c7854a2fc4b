"""The dense layers of a rank of ``--tensor-parallel`` (ranks/parallel.py): what each rank reads of them.

    LM head (every path):   x [.., H] --its rows [lo, lo + n) of the vocabulary (the kernel one process uses)-->
        [.., n] --gathered in rank order (send/recv on gloo; all_gather, padded, on NCCL)--> logits [.., V]
    attention heads, dense MLPs (wherever the fused decode path is off: CUDA, fp32, ...; split_dense):
        q/k/v: its heads' rows (and their biases, sinks) -> attention over its heads alone (its KV pools hold
        only them) -> o_proj: its heads' columns --partial [.., H] summed over the ranks (over_ranks)--> + bias
        gate/up: its rows of the intermediate -> down: its columns --summed over the ranks--> + bias

Why: every rank needs the logits (each samples the same tokens: lockstep), and the head is the largest dense
matrix of most MoE models (V x H, read every token); split, each rank reads 1/N of it for one exchange a token,
and each logit is still one row's dot product: bit for bit. Heads and MLPs split as Megatron-LM splits them: 1/N
of their weights and of the KV cache per rank for one sum per block; that sum is not one process's (two partial
dot products, rounded, then added), so it runs only where the module path decodes. Where the fused decode path
runs (bf16 on the CPU: fastpath.py) the ranks keep whole attention and MLPs: that path reads them itself, and on
one host's shared cores the extra exchange per layer costs about what the halved reads save
(docs/benchmarks/parallel.md).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from moe_offload.engines.offload.kernels import dispatch
from moe_offload.engines.offload.ranks.parallel import exchange, over_ranks


def split(n: int, world: int) -> list[int]:
    """``n`` rows in ``world`` near-equal parts, the larger first: rank r holds sum(parts[:r]) onwards."""
    return [n // world + (r < n % world) for r in range(world)]


class VocabShard(torch.nn.Module):
    """A rank's LM head: its rows of the vocabulary (``split``), its logits gathered from every rank in rank order
    along the last dimension. Each logit is one row's dot product by the kernel one process uses (a row of the
    head is read on one rank only), so the gathered logits are one process's bit for bit where that kernel
    computes each row alone: the one-token kernels (gemv_bf16, gemv_q), as test_parallel.py checks."""

    def __init__(self, part: torch.nn.Module, sizes: list[int]):
        super().__init__()
        self.part, self.sizes = part, sizes

    @property
    def weight(self) -> torch.Tensor:
        """The rank's rows (a family's forward may read the head's weight for its dtype or device)."""
        return self.part.weight_q if hasattr(self.part, "weight_q") else self.part.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dispatch.call(self.part, x)  # its rows on the kernels (bf16 CPU), else the module
        if y.device.type == "cpu":
            return torch.cat(exchange(y, None, lambda r: self.sizes[r]), dim=-1)
        width = self.sizes[0]  # NCCL's all_gather: equal parts, the shorter padded
        y = torch.nn.functional.pad(y, (0, width - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in self.sizes]
        dist.all_gather(parts, y)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.sizes)], dim=-1)


def shard_head(model, rank: int, world: int, rehome: bool) -> None:
    """``model.lm_head`` replaced by this rank's VocabShard: its rows of the weight (a copy, so the full head is
    freed, unless tied to the embeddings: then a view), bias and scales (an nn.Linear's rows on the kernels:
    dispatch.call); ``rehome``: the rows in huge pages as load_model puts the dense weights."""
    import copy

    from moe_offload.engines.offload.loading import hugepages
    from moe_offload.engines.offload.loading.quant import RowsLinear

    head = model.lm_head
    if not isinstance(head, (torch.nn.Linear, RowsLinear)):  # kept whole on every rank
        from moe_offload.log import get_logger

        get_logger("moe_offload.parallel").info("LM head not split over the ranks", head=type(head).__name__)
        return
    sizes = split(head.out_features, world)
    lo, n = sum(sizes[:rank]), sizes[rank]
    embed = model.get_input_embeddings()
    tied = embed is not None and any(t.data_ptr() == embed.weight.data_ptr() for t in head.parameters())

    def rows(t):
        return None if t is None else t[lo:lo + n] if tied else t[lo:lo + n].clone()

    part = copy.copy(head)
    part._parameters, part._buffers = dict(head._parameters), dict(head._buffers)
    part.out_features = n
    if isinstance(head, RowsLinear):
        part.weight_q = rows(head.weight_q)
        if head.weight_scale.numel():
            part.weight_scale = rows(head.weight_scale)
    else:
        part.weight = torch.nn.Parameter(rows(head.weight.data), requires_grad=False)
    if head.bias is not None:
        part.bias = torch.nn.Parameter(rows(head.bias.data), requires_grad=False)
    if "forward" in head.__dict__:  # patched onto the head's instance (dispatch.patch_linears): not the part's
        del part.__dict__["forward"]
    _let_go(head)
    if rehome and not tied:
        hugepages.rehome_module(part)
    model.lm_head = VocabShard(part, sizes)


def _let_go(m: torch.nn.Module) -> None:
    """Drop a replaced linear's patched forward: a method bound to it is a cycle only the cyclic collector frees, and
    the whole weight would stay resident until it ran."""
    m.__dict__.pop("forward", None)


class RankSum(torch.nn.Module):
    """A row-parallel linear: this rank's input columns [lo, hi) of ``linear``, the partial products summed over the
    ranks in rank order (the same sum on every rank), the bias added once after the sum."""

    def __init__(self, linear: torch.nn.Linear, lo: int, hi: int):
        super().__init__()
        self.part = torch.nn.Linear(hi - lo, linear.out_features, bias=False, device="meta")  # no init: replaced
        self.part.weight = torch.nn.Parameter(linear.weight.data[:, lo:hi].contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = over_ranks(self.part(x))
        return y if self.bias is None else y + self.bias


def _rows(linear: torch.nn.Linear, lo: int, hi: int) -> torch.nn.Linear:
    """A column-parallel linear: rows [lo, hi) of ``linear`` (its output features), a copy."""
    out = torch.nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None, device="meta")  # no init: replaced
    out.weight = torch.nn.Parameter(linear.weight.data[lo:hi].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.data[lo:hi].clone(), requires_grad=False)
    return out


_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _split_heads(attn, heads: int, kv_heads: int, rank: int, world: int) -> bool:
    """``attn``'s q/k/v/o (all nn.Linear) cut to this rank's heads; False (left whole) where a part does not split
    per head: heads or KV heads not a multiple of the ranks, a q/k norm over the whole projection."""
    ps = [getattr(attn, a, None) for a in ("q_proj", "k_proj", "v_proj", "o_proj")]
    head_dim = getattr(attn, "head_dim", None)
    other = {n for n, c in attn.named_children() if any(True for _ in c.parameters())} - set(_ATTENTION_PARTS)
    if (any(type(p) is not torch.nn.Linear for p in ps) or head_dim is None or heads % world or kv_heads % world
            or other or {n for n, _ in attn.named_parameters(recurse=False)} - {"sinks"}
            or any(getattr(getattr(attn, n, None), "weight", torch.empty(head_dim)).numel() != head_dim
                   for n in ("q_norm", "k_norm"))):
        return False  # e.g. a gate or sink projection per head (AFMoE, Step3p7): the modules would not line up
    q, k, v, o = ps
    hq, hk = heads // world, kv_heads // world  # this rank's: [rank * hq, (rank + 1) * hq)
    for p in ps:
        _let_go(p)
    for name, p, n, per in (("q_proj", q, hq, q.out_features // heads), ("k_proj", k, hk, k.out_features // kv_heads),
                            ("v_proj", v, hk, v.out_features // kv_heads)):
        setattr(attn, name, _rows(p, rank * n * per, (rank + 1) * n * per))
    dv = o.in_features // heads
    attn.o_proj = RankSum(o, rank * hq * dv, (rank + 1) * hq * dv)
    for a, n in (("num_heads", hq), ("num_attention_heads", hq), ("num_key_value_heads", hk)):
        if isinstance(getattr(attn, a, None), int):  # where a forward shapes by its own count
            setattr(attn, a, n)
    sinks = getattr(attn, "sinks", None)  # gpt-oss: one per head
    if isinstance(sinks, torch.nn.Parameter):
        attn.sinks = torch.nn.Parameter(sinks.data[rank * hq:(rank + 1) * hq].clone(), requires_grad=False)
    return True


def split_dense(model, rank: int, world: int) -> dict[str, int]:
    """Every text layer's softmax attention heads and every MLP outside the experts (dense layers, shared experts) cut
    to this rank's part, where it splits (else whole: MLA and gated-DeltaNet mixers, a vision tower's attention, int8
    or ggml rows, sizes that do not divide). Returns {"attention": layers split, "mlp": MLPs split}."""
    from moe_offload.engines.offload.loading.architecture import decoder_layers
    from moe_offload.engines.offload.loading.quant import MLP_NAMES, dense_linears

    text = {id(layer.self_attn) for layer in decoder_layers(model) if hasattr(layer, "self_attn")}  # cfg's counts
    cfg = model.config.get_text_config()
    heads = getattr(cfg, "num_attention_heads", 0)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    done = {"attention": 0, "mlp": 0}
    for name, module, attrs in dense_linears(model):
        if attrs == MLP_NAMES:
            gate, up, down = (getattr(module, a) for a in MLP_NAMES)
            n = gate.out_features
            if n % world or up.out_features != n or down.in_features != n:
                continue
            lo, hi = rank * n // world, (rank + 1) * n // world
            for m in (gate, up, down):
                _let_go(m)
            module.gate_proj, module.up_proj = _rows(gate, lo, hi), _rows(up, lo, hi)
            module.down_proj = RankSum(down, lo, hi)
            done["mlp"] += 1
        elif attrs == ("q_proj",) and id(module) in text:  # one group per linear: the q_proj names the module
            done["attention"] += _split_heads(module, heads, kv_heads, rank, world)
    dispatch.patch_linears(model)  # the new bf16 CPU linears' one-token calls on the kernels, as load_model set them
    gc.collect()
    return done
