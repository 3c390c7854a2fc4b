"""npu-offload: run Mixture-of-Experts LLMs whose weights do not fit in accelerator memory.

The control plane (this package) never imports torch at import time; engines do.
"""

__version__ = "0.1.0"
