"""llama.cpp's CUDA build beside the engine on a lent GPU (issue 50's bar), in three steps:

    python bench/gpu_llamacpp.py pack                      # here: the llama-cpp-python sdist's llama.cpp, trimmed to
                                                           #   what llama-bench and the converter need -> .gpu/llama.cpp.tar.gz
    python bench/gpu_llamacpp.py build --jobs 12           # there (bench/gpu_run.sh, in the background): cmake
                                                           #   -DGGML_CUDA=ON, llama-bench only, this GPU's architecture
    python bench/gpu_llamacpp.py bench --model-dir M       # there: M's bf16 GGUF, llama-bench -ngl 99 all resident and
                                                           #   with --n-cpu-moe (the experts of the first N layers on the CPU)

The lent machine has no network: the source travels with the working tree (.gpu/ is ignored by git; the device
tool carries it). The GGUF is converted there from the same checkpoint the engine runs (bench_llamacpp.to_gguf: the
demo tokenizer's pre-tokenizer fallback). Output: one line per run, ms/token as llama-bench measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_llamacpp as L  # noqa: E402

PACKED = HERE.parent / ".gpu" / "llama.cpp.tar.gz"
WORK = Path(os.environ.get("GPU_LLAMA_DIR", "/tmp/gpu-llama"))
KEEP = ("CMakeLists.txt", "cmake", "ggml", "src", "include", "common", "vendor", "licenses", "LICENSE",
        "gguf-py", "conversion", "convert_hf_to_gguf.py", "tools/CMakeLists.txt", "tools/llama-bench")
CUDA_OPTIONS = ("-DGGML_CUDA=ON", "-DGGML_NATIVE=OFF", "-DCMAKE_CUDA_ARCHITECTURES=native")


def pack() -> Path:
    tools = L.ensure_llamacpp()
    PACKED.parent.mkdir(exist_ok=True)
    with tarfile.open(PACKED, "w:gz") as tar:
        for name in KEEP:
            if (tools.src / name).exists():
                tar.add(tools.src / name, arcname=f"llama.cpp/{name}")
    print(f"{PACKED}: {PACKED.stat().st_size / 2**20:.1f} MiB (llama-cpp-python {tools.version})")
    return PACKED


def _tools() -> L.LlamaCpp:
    src, build = WORK / "llama.cpp", WORK / "build"
    return L.LlamaCpp("packed", src, build / "bin" / "llama-bench", build / "bin" / "llama-batched-bench")


def build(jobs: int, cpu: bool = False) -> Path:
    """llama-bench from the packed source (``cpu``: the CPU backend only, a dry run of the build here)."""
    t = _tools()
    if not t.src.is_dir():
        with tarfile.open(PACKED) as tar:
            tar.extractall(WORK, filter="data")
    # tools/CMakeLists.txt adds every tool: keep llama-bench's line only (the others were not packed)
    cm = t.src / "tools" / "CMakeLists.txt"
    lines = [x for x in cm.read_text().splitlines() if "add_subdirectory(" not in x or "llama-bench" in x]
    cm.write_text("\n".join(lines) + "\n")
    opts = L.ISA_OPTIONS["native"] if cpu else CUDA_OPTIONS
    L._run(["cmake", "-S", t.src, "-B", t.bench.parent.parent, *L.CMAKE_OPTIONS, *opts])
    L._run(["cmake", "--build", t.bench.parent.parent, "--target", "llama-bench", "-j", str(jobs)])
    print(f"built {t.bench}")
    return t.bench


def bench(model_dir: str, tokens: int, threads: int) -> None:
    t = _tools()
    if not t.bench.is_file():
        raise SystemExit(f"{t.bench}: not built (gpu_llamacpp.py build)")
    gguf = L.to_gguf(model_dir, "bf16", tools=t, cache=WORK)
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    for label, extra in (("all resident", ()), (f"--n-cpu-moe {layers // 2}", ("--n-cpu-moe", str(layers // 2))),
                         (f"--n-cpu-moe {layers * 3 // 4}", ("--n-cpu-moe", str(layers * 3 // 4)))):
        r = L.llama_bench(gguf, tokens, threads=threads, repetitions=3, tools=t, extra=("-ngl", "99", *extra))
        ms = sorted(r["ms_per_token"])
        print(f"llama.cpp -ngl 99 {label:18} {ms[len(ms) // 2]:.2f} ms/token (median of {len(ms)}; {tokens} tokens)",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pack")
    b = sub.add_parser("build")
    b.add_argument("--jobs", type=int, default=12)
    b.add_argument("--cpu", action="store_true", help="the CPU backend only: a dry run of the build")
    r = sub.add_parser("bench")
    r.add_argument("--model-dir", required=True)
    r.add_argument("--tokens", type=int, default=64)
    r.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    if a.cmd == "pack":
        pack()
    elif a.cmd == "build":
        build(a.jobs, a.cpu)
    else:
        bench(a.model_dir, a.tokens, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
