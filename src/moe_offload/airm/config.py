"""The ai-rm runner's configuration: every key, its type and default; values may be JSON strings.

    run(Workload, **config) --RunConfig.parse(config)--> validated, typed config (ContractError otherwise)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from moe_offload import settings
from moe_offload.control import vocab
from rm_core import ContractError

BACKENDS = ("mock", "cpu", "cuda", "rngd")
ROLES = ("worker", "gateway")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EXPERT_DTYPES = tuple(vocab.EXPERT_DTYPES)


@dataclass(frozen=True)
class RunConfig:
    backend: str | None = None  # None: the best available
    model: str = ""
    placement: str | None = None  # a placement JSON file, or "auto"
    policy: str | None = None  # static | lru | hybrid (offload engines)
    fraction: float | None = None  # resident fraction when no placement file is given
    max_num_seqs: int | None = None  # cpu/cuda: sequences batched per step
    max_num_batched_tokens: int | None = None  # cpu/cuda: tokens per step
    kv_cache_memory: str | None = None  # cpu/cuda: KV budget, bytes or "2GiB"
    host_memory: str | None = None  # cpu/cuda: host memory for routed experts, bytes or "8GiB" (the rest on disk)
    max_model_len: int | None = None  # cpu/cuda: longest prompt + output
    block_size: int | None = None  # cpu/cuda: tokens per KV block
    expert_dtype: str | None = None  # int8 | fp8 | bf16 (offload engines; None: as the checkpoint stores them)
    dense_dtype: str | None = None  # int8 | bf16 (cpu offload engine: dense linears and LM head; None: as loaded)
    speculative: str | None = None  # cpu/cuda: vLLM's speculative config (JSON), e.g. {"num_speculative_tokens": 3}
    tail_skip: int | None = None  # cpu/cuda, APPROXIMATE: skip non-resident experts ranked this or lower (0-based)
    cold_dtype: str | None = None  # cpu/cuda, APPROXIMATE: int8 | int4 copy that misses are computed from
    devices: str | None = None  # cpu/cuda: several accelerators, e.g. "cuda:0,cuda:1" (each a tier of its own)
    tensor_parallel: int | None = None  # cpu: ranks on torch.distributed, each with its share of the experts
    enable_prefix_caching: bool = True  # cpu/cuda: reuse the KV blocks of prefixes seen before (serve role)
    kv_cache_dtype: str = "auto"  # cpu/cuda: auto | int8 | fp8 (APPROXIMATE: half the KV bytes, twice the tokens)
    engine: str | None = None  # external engine binary (rngd)
    data: str | None = None  # the external engine's input directory
    role: str = "worker"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None
    gateway: str = field(default_factory=lambda: settings.get("LLMD_GATEWAY_URL") or "")
    wid: str | None = None
    priors: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log: str | None = None
    api_key: str | None = None
    kv_transport: str = ""
    prompt: str = "Hello"
    max_new: int = 32
    repeat: int = 1
    mock: bool = False
    mock_ms: float = 5.0
    mock_hit: float = 0.85
    block: bool = True

    @classmethod
    def keys(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def parse(cls, config: dict[str, Any]) -> "RunConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ContractError(f"config.{unknown[0]}", "one of " + ", ".join(cls.keys()), unknown[0])
        values = {k: _coerce(k, v, known[k].type) for k, v in config.items()}
        return cls(**values)

    def __post_init__(self):
        if self.kv_transport:
            # Expert offloading moves weights and activations between tiers, never KV cache.
            raise ContractError("config.kv_transport", "empty (npu-offload does not transfer KV cache)", self.kv_transport)
        if self.backend is not None and self.backend not in BACKENDS:
            raise ContractError("config.backend", " | ".join(BACKENDS), self.backend)
        if self.role not in ROLES:
            raise ContractError("config.role", " | ".join(ROLES), self.role)
        if not self.host:  # an empty host binds every interface: exposure must be asked for ("0.0.0.0")
            raise ContractError("config.host", "an address to listen on (127.0.0.1; 0.0.0.0 for every interface)", self.host)
        if self.role == "gateway" and self.metrics_port is not None:
            raise ContractError("config.metrics_port", "unset for role=gateway (the gateway serves /metrics on its port)",
                                self.metrics_port)
        if self.log is not None and self.log.lower() not in LOG_LEVELS:
            raise ContractError("config.log", " | ".join(LOG_LEVELS), self.log)
        if not self.prompt:
            raise ContractError("config.prompt", "a non-empty text", self.prompt)
        for name in ("port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ContractError(f"config.{name}", "a port number 0..65535", v)
        for name in ("max_new", "repeat"):
            if getattr(self, name) < 1:
                raise ContractError(f"config.{name}", "an integer >= 1", getattr(self, name))
        if not 0 <= self.mock_hit <= 1:
            raise ContractError("config.mock_hit", "a fraction in 0..1", self.mock_hit)
        if self.mock_ms < 0:
            raise ContractError("config.mock_ms", "milliseconds >= 0", self.mock_ms)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ContractError(f"config.{name}", "an integer >= 1", v)
        for name in ("kv_cache_memory", "host_memory"):
            if getattr(self, name) is None:
                continue
            from moe_offload.control.units import parse_size
            from moe_offload.errors import ConfigError

            try:
                parse_size(getattr(self, name), name)
            except ConfigError:
                raise ContractError(f"config.{name}", "a memory size (bytes, or e.g. 2GiB)", getattr(self, name)) from None
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            raise ContractError("config.expert_dtype", " | ".join(EXPERT_DTYPES), self.expert_dtype)
        if self.dense_dtype is not None and self.dense_dtype not in vocab.DENSE_DTYPES:
            raise ContractError("config.dense_dtype", "int8 | bf16", self.dense_dtype)
        if self.tail_skip is not None and self.tail_skip < 1:
            raise ContractError("config.tail_skip", "a rank >= 1 (the top expert is never skipped)", self.tail_skip)
        if self.cold_dtype is not None and self.cold_dtype not in ("int8", "int4"):
            raise ContractError("config.cold_dtype", "int8 | int4", self.cold_dtype)
        if self.kv_cache_dtype not in vocab.KV_CACHE_DTYPES:
            raise ContractError("config.kv_cache_dtype", " | ".join(vocab.KV_CACHE_DTYPES), self.kv_cache_dtype)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ContractError("config.enable_prefix_caching", "true or false", self.enable_prefix_caching)
        if self.tensor_parallel is not None and (isinstance(self.tensor_parallel, bool)
                                                 or not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1):
            raise ContractError("config.tensor_parallel", "a number of ranks >= 1", self.tensor_parallel)
        if self.devices is not None:
            from moe_offload.control.devices import parse
            from moe_offload.errors import ConfigError

            try:
                parse(self.devices)
            except ConfigError as e:
                raise ContractError("config.devices", "a list such as cuda:0,cuda:1", self.devices) from e
        if self.speculative is not None:
            from moe_offload.engines.params import SpeculativeConfig
            from moe_offload.errors import ConfigError

            try:
                SpeculativeConfig.parse(self.speculative)
            except ConfigError as e:
                raise ContractError("config.speculative", "vLLM's speculative config as JSON", str(e)) from None
        if self.fraction is not None and not 0 <= self.fraction <= 1:
            raise ContractError("config.fraction", "a fraction in 0..1", self.fraction)
        from moe_offload.serving.classify import CLASSES

        for cls_name, rate in self.priors.items():
            if cls_name not in CLASSES and cls_name != "all":
                raise ContractError(f"config.priors[{cls_name}]", "a request class: all, " + ", ".join(CLASSES), cls_name)
            if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
                raise ContractError(f"config.priors[{cls_name}]", "a hit rate in 0..1", rate)
        for k, v in self.env.items():
            if not isinstance(v, str):
                raise ContractError(f"config.env[{k}]", "a string", v)

    @property
    def backend_name(self) -> str | None:
        return "mock" if self.mock else self.backend


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Turn ``value`` (possibly a JSON string, as from a command line) into the annotated type."""
    kind = str(annotation)
    if isinstance(value, str) and not kind.startswith("str"):
        text = value.strip()
        if kind.startswith("bool") and text.lower() in ("true", "false", "1", "0", "yes", "no"):
            return text.lower() in ("true", "1", "yes")
        try:
            value = json.loads(text)
        except ValueError:
            if kind.startswith("dict"):
                raise ContractError(f"config.{key}", "a JSON object", value) from None
            if "None" in kind and text == "":
                return None
            raise ContractError(f"config.{key}", f"a value of type {kind}", value) from None
    if value is None:
        if "None" in kind:
            return None
        raise ContractError(f"config.{key}", f"a value of type {kind}", value)
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise ContractError(f"config.{key}", "a string", value)
        return value
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ContractError(f"config.{key}", "true or false", value)
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ContractError(f"config.{key}", "an integer", value)
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ContractError(f"config.{key}", "a number", value)
        return float(value)
    if kind.startswith("dict"):
        if not isinstance(value, dict):
            raise ContractError(f"config.{key}", "a JSON object", value)
        return dict(value)
    return value
