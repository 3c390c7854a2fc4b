"""Builds the CPU kernels at install: one library per ISA variant (engines/offload/kernels/buildinfo.py), picked at
run time by CPUID (kernels/jit.py), so no compiler or ninja is needed at run time.

torch must be importable while building: `pip install --no-build-isolation .` (scripts/setup.sh does; build isolation
would fetch another, multi-GB torch). Without torch the package installs without them (the start log, /metrics and
`moe-offload selftest` then say so, and they are built at first use where a compiler exists).
"""

import json
import os
import runpy
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
KERNELS = Path("engines/offload/kernels")


def kernels() -> dict:
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("npu-offload: torch is not importable at build time (pip's build isolation?): the CPU kernels are "
              "not prebuilt; install with --no-build-isolation after torch")
        return {}
    info = runpy.run_path(str(HERE / KERNELS / "buildinfo.py"))
    csrc = KERNELS / "csrc" / "cpu"
    sources = sorted(str(p) for p in csrc.glob("*.cpp"))
    # -g0 / -s: no debug information (the libraries are ~10x smaller)
    exts = [CppExtension(f"moe_offload.engines.offload.kernels.{info['prebuilt_name'](name)}", sources,
                         include_dirs=[str(HERE / csrc)], extra_compile_args=[*info["BASE_CFLAGS"], *flags, "-g0"],
                         extra_link_args=["-fopenmp", "-s"])
            for name, _, flags in info["VARIANTS"]]

    class Build(BuildExtension):
        """Each variant compiles the same sources with its own flags: its own temp directory for the objects; then
        the stamp that tells jit.py which torch and which sources the libraries were built from."""

        def build_extension(self, ext):
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

        def run(self):
            super().run()
            stamp = {"torch": torch.__version__, "source_hash": info["source_hash"](HERE / KERNELS / "csrc"),
                     "variants": [name for name, _, _ in info["VARIANTS"]]}
            out = Path(self.get_ext_fullpath(exts[0].name)).parent / info["STAMP"]
            out.write_text(json.dumps(stamp, indent=1) + "\n")

    return {"ext_modules": exts, "cmdclass": {"build_ext": Build.with_options(use_ninja=True)}}


setup(**kernels())
