"""torch.compile as the generic fast decode path (issue 18, option 1): what compiling a family's small modules buys.

    python bench/bench_compile.py --model-dir /tmp/families/deepseek_v3 --tokens 32

    engine (static, fraction 1, bf16) --decode ms/token, eager, median of 32 steps (twice)
      --torch.compile every RMSNorm and router module's forward (dynamic=False), seconds to compile (first steps)
      --decode ms/token, compiled (twice) --> one line per measurement

A whole decode step cannot be captured: the offload executor (Python: tiers, fetches, statistics) runs between
each layer's attention and its experts, so each small module is compiled on its own. The fused decode paths are
switched off (model_runner.decode_plan replaced) so both sides run transformers' modules. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    a = ap.parse_args(argv)
    import torch
    from bench_engine import prompt_ids
    from bench_llamacpp import engine_decode

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime import model_runner
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    model_runner.decode_plan = lambda *a: None  # transformers' modules on both sides

    torch.set_num_threads(2)
    e = build_offload_engine(a.model_dir, policy="static", fraction=1.0, dtype="bfloat16")
    try:
        prompt = prompt_ids(a.context, ModelSpec.from_hf_config(a.model_dir).vocab_size)
        engine_decode(e, prompt, 2)
        eager = [statistics.median(engine_decode(e, prompt, a.tokens)) for _ in range(2)]
        t0 = time.perf_counter()
        n = 0
        for mod in e.model.modules():
            name = type(mod).__name__
            if name.endswith("RMSNorm") or name.endswith("Router"):
                mod.forward = torch.compile(mod.forward, dynamic=False)
                n += 1
        engine_decode(e, prompt, 3)  # compiles
        compile_s = time.perf_counter() - t0
        compiled = [statistics.median(engine_decode(e, prompt, a.tokens)) for _ in range(2)]
    finally:
        e.close()
    print(f"{a.model_dir.name}: eager {' / '.join(f'{x:.1f}' for x in eager)} ms/token; {n} modules compiled in "
          f"{compile_s:.0f} s; compiled {' / '.join(f'{x:.1f}' for x in compiled)} ms/token "
          f"({a.tokens} tokens after {a.context}, medians, module path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
