"""One rank of --tensor-parallel, started by rank 0 (parallel.launch) as torchrun would start it.

    python -m moe_offload.engines.offload.ranks.rank --rank R --world N --port P --threads T  < spec JSON
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_offload.engines.offload.ranks.parallel import follow
from moe_offload.engines.offload.runtime.build import build_offload_engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_offload.engines.offload.ranks.rank",
                                 description="one rank of --tensor-parallel (started by rank 0)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rank 0 shows the load
    return follow(build_offload_engine, a.rank, a.world, a.port, a.threads, json.loads(sys.stdin.read()))


if __name__ == "__main__":
    sys.exit(main())
