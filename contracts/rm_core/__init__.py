"""rm-core: the contracts between ai-rm and its workloads.

Pure Python, no third-party imports: an orchestrator loads this before it
knows which workload it will run.
"""

from rm_core.contracts import (
    ACCELERATOR_ID_PATTERN,
    TIER_KINDS,
    WORKLOAD_KINDS,
    LayerPlacement,
    Measurement,
    MemoryTier,
    Placement,
    Workload,
)
from rm_core.errors import ContractError
from rm_core.metrics import METRICS, MetricSpec
from rm_core.version import PROTOCOL_VERSION

__all__ = [
    "ACCELERATOR_ID_PATTERN",
    "METRICS",
    "PROTOCOL_VERSION",
    "TIER_KINDS",
    "WORKLOAD_KINDS",
    "ContractError",
    "LayerPlacement",
    "Measurement",
    "MemoryTier",
    "MetricSpec",
    "Placement",
    "Workload",
]
