"""The mock backend: a deterministic engine without a model, always available."""

from __future__ import annotations

from moe_offload.backends import Backend, host_tier, node_name
from moe_offload.hooks import hookimpl
from rm_core import MemoryTier

# The mock accelerator's memory is simulated, and labelled so.
MOCK_DEVICE_BYTES = 16 * 1024**3


class MockBackend(Backend):
    name = "mock"
    description = "deterministic engine without a model (tests, demos, orchestrator integration)"

    def tiers(self):
        return [
            MemoryTier(
                name="mock:0",
                kind="device-hbm",
                capacity_bytes=MOCK_DEVICE_BYTES,
                accelerator=f"{node_name()}/mock:0",
                labels={"simulated": "true"},
            ),
            host_tier(),
        ]

    def build_engine(self, model=None, placement=None, **options):
        from moe_offload.engines.mock import MockConfig, MockEngine

        keys = {"ms_per_token", "hit_rate", "max_model_len", "policy"}
        cfg = MockConfig(**{k: v for k, v in options.items() if k in keys})
        return MockEngine(cfg, model=model or "mock")


@hookimpl
def moe_offload_register_backends(register):
    register(MockBackend())
