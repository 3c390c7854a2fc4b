"""Weight bytes of a model: one expert, a layer's and all routed experts as held (their format: the checkpoint's, or
``--expert-dtype``'s; a GGUF file's exact per-layer sizes), the checkpoint as shipped, and the non-expert weights in the
compute dtype. What the planner, the budget and the host store count.

A mixin of ``spec.ModelSpec``: the properties read the spec's fields and parameter counts; sizes in bytes.
"""

from __future__ import annotations

from moe_offload.control.vocab import DTYPE_BYTES, QUANTIZED_FORMATS, stored_weight_bytes


class WeightBytes:
    """Weight bytes of a ModelSpec (mixed into it; reads its fields)."""

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert as held in memory (its format: ``expert_format``, default the dtype); a GGUF
        file's largest (what a slot must hold)."""
        if self._as_file:
            return max(self.stored_layer_expert_bytes)
        return self.stored_expert_bytes(self.expert_format or self.dtype)

    @property
    def _as_file(self) -> bool:
        """The experts are held as a GGUF file stores them (not dequantized by --expert-dtype bf16)."""
        return bool(self.stored_layer_expert_bytes) and self.expert_format == self.checkpoint_expert_format

    def stored_expert_bytes(self, fmt: str) -> int:
        """Bytes of one routed expert stored in ``fmt`` (a quantized format, or a float dtype name); biases keep
        the dtype. A concatenated gate|up in fp8 keeps the halves' blocks apart (gpt-oss interleaves them)."""
        H, I = self.hidden_size, self.expert_intermediate_size
        if fmt not in QUANTIZED_FORMATS:
            return self.expert_params * DTYPE_BYTES[fmt]
        up = 2 * I if self.mlp_gated else I  # gate|up rows, or up alone (Nemotron-H's relu2 experts)
        split = I if fmt == "fp8" and self.model_type != "gpt_oss" and self.mlp_gated else 0
        bias = (up + H) * self.dtype_bytes if self.expert_bias else 0
        order = 4 * (H + I) if self.act_order and fmt == self.checkpoint_expert_format else 0  # int32 input orders
        return stored_weight_bytes(fmt, up, H, split) + stored_weight_bytes(fmt, H, I) + bias + order

    @property
    def layer_expert_bytes(self) -> int:
        """Bytes of one MoE layer's routed experts."""
        return self.num_experts * self.expert_bytes

    @property
    def routed_expert_bytes(self) -> int:
        if self._as_file:
            return self.num_experts * sum(self.stored_layer_expert_bytes)
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint's tensors as shipped: experts in ``checkpoint_expert_format``; in an FP8 release
        also every linear but the router and LM head in block FP8, and the routing correction bias in fp32."""
        if self.file_bytes:
            return self.file_bytes
        fmt = self.checkpoint_expert_format or self.dtype
        experts = self.num_moe_layers * self.num_experts * self.stored_expert_bytes(fmt)
        rest = self.non_expert_bytes
        if fmt in ("fp8", "nvfp4"):
            shapes = [s for i in range(self.num_layers) for s in self.layer_linear_shapes(i, self.attention_quantized)]
            rest += sum(_shipped(fmt, r, c) - r * c * self.dtype_bytes for r, c in shapes)
        if fmt == "fp8" and self.router_correction_bias:
            rest += self.num_moe_layers * self.num_experts * (4 - self.dtype_bytes)
        if fmt == "nvfp4":  # the release's 8 bytes of scales per linear, not the engine's 4 per row
            H, I, m = self.hidden_size, self.expert_intermediate_size, 3 if self.mlp_gated else 2
            experts += self.num_moe_layers * self.num_experts * (8 * m - 4 * ((m - 1) * I + H))
        return rest + experts

    def layer_linear_shapes(self, layer: int, attention: bool = True) -> list[tuple[int, int]]:
        """[out, in] of every linear weight of one decoder layer but the routed experts and the router: attention
        (unless not ``attention``) and the dense or shared-expert MLP (what an FP8 or NVFP4 release quantizes)."""
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
        shapes = shapes if attention else []
        inter = self.shared_intermediate_size if layer in self._moe_set else self.dense_intermediate_size
        if inter:
            shapes += [(inter, H), (inter, H), (H, inter)]
        if layer in self._moe_set and self.shared_expert_gate:
            shapes.append((1, H))
        return shapes

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


def _shipped(fmt: str, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] linear as an FP8 or NVFP4 release ships it (NVFP4: e2m1 pairs, an e4m3 scale per 16,
    the fp32 weight_scale_2 and input_scale)."""
    if fmt == "nvfp4":
        return rows * cols // 2 + rows * cols // 16 + 8
    return stored_weight_bytes(fmt, rows, cols)
