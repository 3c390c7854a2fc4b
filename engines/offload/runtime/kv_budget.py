"""KV memory as a budget: how many bytes a token's KV takes, how many bytes the pool gets, how many blocks that is.

    model --probe_kv_bytes (one 2-token forward on a shape-recording cache)--> (bytes / token, state bytes /
      sequence), or None (None: a layer keeps state the pool cannot hold; each sequence then runs on the model's own
      cache). State: a linear-attention layer's conv window and recurrent state (model/deltanet.py), fixed-size.
      (a quantized cache, cache_dtype int8 | fp8: one byte a value plus a 4-byte scale per (token, head): kv.py)
    KVCacheConfig.kv_cache_memory | 80 % of free CUDA memory | 4 GiB on cpu --budget_bytes--> bytes
    (bytes - max_num_seqs * state bytes) / (bytes per token * block_size), capped at max_num_seqs full-length
      sequences --make_pool--> KVPool (+ max_num_seqs state seats) + max_model_len (capped to what the pool holds)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_offload.engines.offload.runtime import kv, kv_quant
from moe_offload.errors import ConfigError, require_count
from moe_offload.hostmem import DEFAULT_KV_HOST  # the KV budget on a cpu device when memory allows
from moe_offload.log import get_logger

log = get_logger("engine.offload")


@dataclass(frozen=True)
class KVCacheConfig:
    """KV memory, in vLLM's terms. ``kv_cache_memory``: bytes for the block pool (None: 4 GiB on a cpu device,
    80 % of the free memory after loading on cuda). ``max_model_len``: longest sequence (prompt + output) served
    (None: the model's, capped to what the pool holds). ``block_size``: tokens per block. ``cache_dtype``: "auto"
    (the model dtype) or a quantized cache, "int8" | "fp8" (e4m3; "fp8_e4m3" alike): APPROXIMATE, about half the
    bytes of bf16 (vLLM's --kv-cache-dtype)."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    cache_dtype: str = "auto"

    def __post_init__(self):
        if self.cache_dtype not in kv_quant.CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: expected one of {', '.join(kv_quant.CACHE_DTYPES)}, got {self.cache_dtype!r}")
        require_count("block_size", self.block_size, optional=False)
        require_count("kv_cache_memory", self.kv_cache_memory)
        require_count("max_model_len", self.max_model_len)

    @property
    def codes(self) -> torch.dtype | None:
        """The quantized cache's storage dtype (kv_quant.CACHE_DTYPES), None for the model dtype."""
        return kv_quant.CACHE_DTYPES[self.cache_dtype]


def probe_kv_bytes(model, executor, device: torch.device, codes: torch.dtype | None = None) -> tuple[int, int] | None:
    """(KV bytes per token, state bytes per sequence) of the paged path (``codes``: a quantized cache's storage), or None when a layer needs more than
    ``cache.update`` or a seat of per-sequence state, on this rank or (``--tensor-parallel``) on any. Leaves the paged
    attention set on the model when it returns bytes, the model's own otherwise. A torch.distributed error (a rank
    gone, a collective timed out) is raised, not taken for a layer the pool cannot hold; gloo's, plain RuntimeErrors,
    surface at the agreement that follows (its all-reduce fails with the rank gone)."""
    kv.register()
    old = kv.set_attention(model, kv.ATTENTION)
    cache = kv.PagedCache(None)
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    pos = torch.arange(2, device=device).unsqueeze(0)
    if executor is not None:
        executor.dry = True
    try:
        with torch.inference_mode(), kv.active(kv.StepContext(slot_mapping=None, seqs=[], probe=True)):
            model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    except torch.distributed.DistError:
        kv.set_attention(model, old)
        raise  # a rank gone or a collective timed out (--tensor-parallel): not a fact about the model
    except Exception as e:  # noqa: BLE001 - any failure means: not this path
        log.debug("paged KV probe failed", error=f"{type(e).__name__}: {e}")
        cache.seen.clear()
    finally:
        if executor is not None:
            executor.dry = False
    layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0)
    if executor is not None and getattr(executor, "stats", None) is not None:
        executor.stats.reset()  # the probe is not a request
    ok = bool(cache.seen) and len(cache.seen) + len(cache.stateful) == layers
    if getattr(executor, "ep", None) is not None and executor.ep[1] > 1:
        from moe_offload.engines.offload.ranks.parallel import agree

        ok = agree(ok)  # every rank pages or none: their steps must run the same collectives
    if not ok:
        kv.set_attention(model, old)
        return None
    total = 0
    for kshape, vshape, dtype in cache.seen.values():  # [1, Hkv, 2, D]
        values, heads = kshape[1] * kshape[3] + vshape[1] * vshape[3], kshape[1] + vshape[1]
        if codes is None:
            total += values * torch.empty((), dtype=dtype).element_size()
        else:  # one byte a value, an fp32 scale a head
            total += values + 4 * heads
    return total, sum(cache.stateful.values())


def budget_bytes(asked: int | None, device: torch.device) -> int:
    """The pool's bytes: what was asked, else 80 % of the free CUDA memory, else ``DEFAULT_KV_HOST``."""
    if asked is not None:
        return asked
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return DEFAULT_KV_HOST


def make_pool(config: KVCacheConfig, *, budget: int, bytes_per_token: int | None, max_num_seqs: int, model_len: int,
              device: torch.device, state_bytes: int = 0) -> tuple[kv.KVPool, int]:
    """The block pool for ``budget`` bytes, and the longest sequence it serves (``max_model_len``, capped).
    ``bytes_per_token`` None: the model's own caches hold the state; the pool only counts tokens for admission.
    ``state_bytes``: each sequence's fixed-size state (linear attention), taken from the budget for every seat."""
    want_len = min(config.max_model_len or model_len, model_len)
    bs = config.block_size
    blocks = -(-max_num_seqs * want_len // bs)  # every seat at full length: never more is needed
    if state_bytes:
        if budget <= max_num_seqs * state_bytes:
            raise ConfigError(f"kv_cache_memory: {budget} bytes do not hold the linear-attention state of "
                              f"max_num_seqs={max_num_seqs} sequences ({state_bytes} bytes each) and any KV; give more, "
                              "or fewer sequences")
        budget -= max_num_seqs * state_bytes
    if bytes_per_token is not None:
        fit = budget // (bytes_per_token * bs)
        if fit < 1:
            raise ConfigError(f"kv_cache_memory: {budget} bytes hold no block of {bs} tokens "
                              f"({bytes_per_token * bs} bytes); give more")
        blocks = min(fit, blocks)
    pool = kv.KVPool(int(blocks), bs, device, seats=max_num_seqs, codes=config.codes)
    max_len = min(want_len, pool.num_blocks * bs)
    if max_len < want_len:
        log.warning("max_model_len capped to what the KV budget holds", max_model_len=max_len, asked=want_len,
                    kv_cache_memory=budget)
    return pool, max_len
