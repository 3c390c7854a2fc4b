"""One engine's decode alone, in this process: the fused path's ms/token on a checkpoint, four 64-token decodes after a
128-token prompt (bf16, every expert resident, as bench_families.py's in-process rounds decode), printed with their
median. For A/Bs of two trees in alternating fresh processes: run the other tree's copy of this script with that
tree installed first on PYTHONPATH (docs/benchmarks/families.md).

    python bench/engine_decode_ms.py /tmp/families/ernie4_5_moe new
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import prompt_ids  # noqa: E402
from bench_llamacpp import engine_decode  # noqa: E402


def main() -> None:
    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    path, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    e = build_offload_engine(path, policy="static", fraction=1.0, dtype="bfloat16")
    prompt = prompt_ids(128, ModelSpec.from_hf_config(path).vocab_size)
    engine_decode(e, prompt, 2)  # warm-up, as bench_families does
    ms = [statistics.fmean(engine_decode(e, prompt, 64)) for _ in range(4)]
    e.close()
    print(label, " ".join(f"{m:.2f}" for m in ms), "median", f"{statistics.median(ms):.2f}", flush=True)


if __name__ == "__main__":
    main()
