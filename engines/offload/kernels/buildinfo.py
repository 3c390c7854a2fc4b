"""What a build of the CPU kernels is, in plain Python (no torch): read by setup.py, which builds every variant at
install, and by jit.py, which picks one at run time.

    VARIANTS (best first) --setup.py: one library per variant--> kernels/_cpu_<variant>.<ext suffix> + STAMP
    run time: CPUID picks a variant --its prebuilt library, when STAMP matches torch and the sources--> loaded
                                    --else (an edited checkout, another torch)--> built at first use (jit.py)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# ISA variants, best first: (name, /proc/cpuinfo flags it needs, compiler flags)
VARIANTS = (
    # every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) also has VNNI, which the int8 kernels use
    ("avx512bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c"),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c", "-DMOE_AVX512BF16")),
    ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DMOE_AVX2")),
    ("portable", (), ()),
)
# -fopenmp: at::parallel_for is an inline OpenMP region; without it the kernel would run on one thread. The library
# then needs libgomp.so.1, which resolves to the copy torch already loaded (one thread pool).
BASE_CFLAGS = ("-O3", "-fopenmp")
STAMP = "_cpu_build.json"  # {"torch": version built against, "source_hash": source_hash(csrc), "variants": [...]}


def prebuilt_name(variant: str) -> str:
    """The module name of a variant's prebuilt library (kernels/_cpu_<variant>)."""
    return f"_cpu_{variant}"


def source_hash(csrc: Path) -> str:
    """sha256 of every file under ``csrc`` (headers and .clang-format included), path and bytes, in path order."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(csrc).rglob("*") if p.is_file()):
        h.update(f.relative_to(csrc).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
