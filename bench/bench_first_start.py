"""First start on a fresh install, as a user meets it: a new venv from the built wheel, no compiler on PATH.

    python bench/bench_first_start.py --wheel dist/npu_offload-*.whl [--rounds 3]

    fresh venv (torch==2.13.0 CPU, then the wheel and its dependencies from the package index)
      after:  the wheel as built (every ISA variant of the kernels inside), PATH = the venv's bin only (no c++, no
              g++, no system ninja), a fresh cache: `moe-offload demo-model`; `moe-offload generate` (demo model,
              8 tokens) twice, each a fresh process timed from exec to exit; `moe-offload selftest`
      before: the same venv with the prebuilt libraries removed and the system PATH back (the kernels as they were
              before: compiled at the first start into the cache), the same commands
      --> table: seconds per command, median of the rounds; the kernels line of selftest for each

Not part of CI (it installs a venv and takes minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORCH = "torch==2.13.0"


def sh(argv, env=None, check=True) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dt, r


def venv(root: Path, wheel: Path) -> Path:
    sh([sys.executable, "-m", "venv", str(root)])
    py = root / "bin" / "python"
    sh([py, "-m", "pip", "install", "-q", TORCH])
    sh([py, "-m", "pip", "install", "-q", str(wheel)])
    return py


def run_commands(py: Path, env: dict, label: str) -> dict:
    """selftest, demo-model and a first and a second generate, each a fresh process, timed."""
    bin_ = str(py.parent)
    out = {}
    out["demo_model_s"], _ = sh([f"{bin_}/moe-offload", "demo-model"], env=env)
    gen = [f"{bin_}/moe-offload", "generate", "--prompt", "The river runs", "--max-tokens", "8", "--ignore-eos"]
    out["first_generate_s"], _ = sh(gen, env=env)  # the first process that loads the kernels
    out["second_generate_s"], _ = sh(gen, env=env)
    dt, r = sh([f"{bin_}/moe-offload", "selftest"], env=env, check=False)
    out["selftest_s"] = dt
    out["selftest_rc"] = r.returncode
    out["kernels_line"] = next((x for x in r.stdout.splitlines() if "kernels" in x), "")
    print(f"  {label}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()),
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="first-start-"))
    try:
        py = venv(work / "venv", args.wheel.resolve())
        site = Path(sh([py, "-c", "import moe_offload.engines.offload.kernels as k, os; print(os.path.dirname(k.__file__))"])[1]
                    .stdout.strip())
        libs = sorted(site.glob("_cpu_*.so"))
        assert libs, f"the wheel holds no prebuilt kernels ({site})"
        no_compiler = str(work / "nobin")
        os.makedirs(no_compiler)
        rows: dict[str, list[dict]] = {"after (prebuilt, no compiler on PATH)": [], "before (built at first start)": []}
        for i in range(args.rounds):
            for label in rows:
                cache = work / f"cache-{i}-{label[:5]}"
                env = {"HOME": str(work / "home"), "MOE_OFFLOAD_CACHE_DIR": str(cache), "LANG": "C.UTF-8"}
                if label.startswith("after"):
                    env["PATH"] = f"{py.parent}:{no_compiler}"
                    for lib in libs:  # back in place (the before round moved them)
                        if not lib.exists():
                            shutil.move(str(work / lib.name), lib)
                    assert not shutil.which("c++", path=env["PATH"]) and not shutil.which("g++", path=env["PATH"])
                else:
                    env["PATH"] = f"{py.parent}:{os.environ['PATH']}"
                    for lib in libs:
                        shutil.move(str(lib), work / lib.name)
                rows[label].append(run_commands(py, env, f"round {i + 1} {label}"))
        print("\n| install | selftest kernels line | selftest s | demo-model s | first generate s | second generate s |")
        print("|---|---|---|---|---|---|")
        for label, runs in rows.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("selftest_s", "demo_model_s", "first_generate_s",
                                                                      "second_generate_s")}
            print(f"| {label} | `{runs[-1]['kernels_line']}` (rc {runs[-1]['selftest_rc']}) | {med['selftest_s']:.1f} | "
                  f"{med['demo_model_s']:.1f} | {med['first_generate_s']:.1f} | {med['second_generate_s']:.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
