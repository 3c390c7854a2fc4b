"""Fuzz the worker's API from its own /openapi.json with schemathesis; fail on any 5xx, a response that breaks the
documented schema, or a worker that is not healthy afterwards.

    python scripts/fuzz_api.py                          # mock engine, 100 examples per operation (about 1 min)
    python scripts/fuzz_api.py --backend cpu --examples 30 --max-time 900   # the demo model: slow, engine paths too

The mock engine covers the API surface (validation, errors, logprobs, echo, n / best_of, tokenize); the cpu
backend adds the engine's own paths (penalties, structured output, tools) at a few ms per token. Checks: no
server error, response bodies, status codes, content types and headers as documented. Schemathesis's
positive/negative data checks are left out: the worker is stricter than JSON Schema can say (strict JSON
types, rules across fields such as best_of >= n), so those report documented 400s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

CHECKS = "not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance,response_headers_conformance"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mock", choices=("mock", "cpu"))
    ap.add_argument("--model", help="cpu backend: checkpoint directory (default: the demo model)")
    ap.add_argument("--examples", type=int, default=100, help="test cases per operation and phase (schemathesis -n)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-time", type=int, help="seconds for the whole run (schemathesis --max-time)")
    args = ap.parse_args(argv)

    from moe_offload.backends import get_backend
    from moe_offload.serving.server import start_server
    from moe_offload.serving.worker import create_app

    if args.backend == "mock":
        engine = get_backend("mock").build_engine("mock", ms_per_token=0, max_model_len=4096)
    else:
        from moe_offload.demo import ensure_demo_model

        engine = get_backend("cpu").build_engine(args.model or str(ensure_demo_model()), fraction=0.5, policy="static")
    h = start_server(create_app(engine, model_name="fuzz", request_timeout=3600), "127.0.0.1", 0)
    try:
        st = Path(sys.executable).with_name("schemathesis")
        cmd = [str(st), "run", f"{h.url}/openapi.json", "-n", str(args.examples), "--seed", str(args.seed), "-c", CHECKS,
               "-w", "1", "--no-shrink", "--request-timeout", "600", "--output-truncate", "false"]
        if args.max_time:
            cmd += ["--max-time", str(args.max_time)]
        with tempfile.TemporaryDirectory(prefix="fuzz-api-") as cwd:  # schemathesis keeps a cache in its working directory
            rc = subprocess.call(cmd, cwd=cwd)
        health = httpx.get(f"{h.url}/health", timeout=30).status_code
        print(f"fuzz_api: schemathesis exit {rc}; /health after the run: {health}")
        return rc if rc else (0 if health == 200 else 1)
    finally:
        h.stop()


if __name__ == "__main__":
    sys.exit(main())
