"""The ai-rm adapter: the workload runner ``airm.workloads:npu-offload``.

    registry.load("airm.workloads", "npu-offload") -> run
    run(Workload(kind="decode"), **config) -> [Measurement]       (runner.py: KPI decode runs)
    run(Workload(kind="serve"), **config)  -> blocks, or a handle  (serve.py: the worker or gateway)
    config.py: every key, typed and validated; power.py: card power for the measurements

Importing this package opens no device, starts no engine and imports no torch.
"""

from moe_offload.airm.runner import run

__all__ = ["run"]
