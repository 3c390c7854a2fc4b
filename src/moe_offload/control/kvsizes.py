"""KV-cache and per-sequence state sizes of a model, per layer kind: what the KV budget and the planner count.

    full/sliding/chunked attention: 2 x nkv x hd per token (MLA: the compressed latent + the rope key)
    indexed attention: + the indexer's key;  linear attention / conv: a constant state per sequence

A mixin of ``spec.ModelSpec``: the methods read the spec's fields; sizes in bytes.
"""

from __future__ import annotations

from moe_offload.control import layerkinds
from moe_offload.errors import ConfigError


class KVSizes:
    """KV-cache and state bytes of a ModelSpec (mixed into it; reads its fields)."""

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
