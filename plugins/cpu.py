"""The CPU backend: the offload executor with the accelerator device = cpu.

Slot caches, policies, statistics and exactness run for real; only the bus
does not. With fraction 0 it is the "all experts on the host" baseline.
"""

from __future__ import annotations

from moe_offload.backends import Backend, disk_tier, host_memory_bytes, host_tier, node_name
from moe_offload.hooks import hookimpl
from rm_core import MemoryTier


class CpuBackend(Backend):
    name = "cpu"
    description = "the offload executor on the CPU (device = cpu); slot caches, policies and stats run for real"

    def tiers(self):
        # The emulated accelerator shares host DRAM; its tier is labelled so that nobody adds the two up.
        return [
            MemoryTier(
                name="cpu:0",
                kind="host-dram",
                capacity_bytes=host_memory_bytes(),
                accelerator=f"{node_name()}/cpu:0",
                labels={"emulates": "device-hbm", "shares": "host"},
            ),
            host_tier(),
            disk_tier(),
        ]

    def build_engine(self, model=None, placement=None, **options):
        from moe_offload.engines.offload.runtime.build import build_offload_engine

        return build_offload_engine(model, placement, device="cpu", backend=self.name, **options)


@hookimpl
def moe_offload_register_backends(register):
    register(CpuBackend())
