"""Building the engine for an ai-rm workload, shared by both kinds (decode runs and serve).

    RunConfig --backend (named | best available)--> tiers (logged) --build_engine(model, placement, options)--> Engine

Every failure is a ContractError: at the rm-core boundary bad input is the caller's, in the contract's words.
"""

from __future__ import annotations

from typing import Any

from rm_core import ContractError, MemoryTier


def log_tiers(tiers: list[MemoryTier], log) -> None:
    """One structured event per tier, at start-up."""
    for t in tiers:
        log.info(
            "memory_tier",
            tier=t.name,
            kind=t.kind,
            accelerator=t.accelerator,
            capacity_bytes=t.capacity_bytes,
            reserved_bytes=t.reserved_bytes,
        )


def engine_options(cfg, serving: bool = False) -> dict[str, Any]:
    """The backend's engine options from the runner config (``serving``: prefix caching as configured; a measured
    decode run repeats its prompt, and a cache would measure the cache)."""
    from moe_offload.backends import engine_options as options
    from moe_offload.control.units import parse_size

    kv, host = cfg.kv_cache_memory, cfg.host_memory
    return options(cfg.backend_name or "", policy=cfg.policy, fraction=cfg.fraction, mock_ms=cfg.mock_ms,
                   mock_hit=cfg.mock_hit, engine=cfg.engine, data=cfg.data, env=cfg.env, max_num_seqs=cfg.max_num_seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
                   block_size=cfg.block_size, kv_cache_memory=parse_size(kv, "kv_cache_memory") if kv is not None else None,
                   expert_dtype=cfg.expert_dtype, dense_dtype=cfg.dense_dtype,
                   host_memory=parse_size(host, "host_memory") if host is not None else None,
                   speculative=cfg.speculative or None, tail_skip=cfg.tail_skip, cold_dtype=cfg.cold_dtype,
                   devices=cfg.devices, tensor_parallel=cfg.tensor_parallel,
                   enable_prefix_caching=cfg.enable_prefix_caching if serving else None,
                   kv_cache_dtype=cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else None)


def build(cfg, log, serving: bool = False):
    """Pick the backend, log its tiers, build the engine. Returns (backend, engine, tiers, model)."""
    from moe_offload import backends
    from moe_offload.errors import OffloadError

    try:
        backend = backends.get_backend(cfg.backend_name) if cfg.backend_name else backends.best_available()
        backend.require()
        tiers = backend.tiers()
        if cfg.devices:  # several accelerators: one tier each
            from moe_offload.control.devices import device_tiers, parse

            tiers = device_tiers(parse(cfg.devices), tiers)
        log_tiers(tiers, log)
        model = cfg.model
        if not model and backend.name in ("cpu", "cuda"):
            from moe_offload.demo import default_model

            model = str(default_model())
        placement = None if cfg.placement in (None, "", "auto") else cfg.placement
        engine = backend.build_engine(model or "mock", placement, **engine_options(cfg, serving))
    except OffloadError as e:
        # At the rm-core boundary every bad input is a ContractError.
        raise ContractError("config", "a configuration this machine can run", str(e)) from None
    log.info("engine_ready", backend=backend.name, model=engine.info.model, policy=engine.info.policy)
    return backend, engine, tiers, model or "mock"
