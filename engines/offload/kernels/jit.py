"""The loader of the CPU kernels: the library built at install for this CPU's ISA, else a build at first use; its
ops register as ``torch.ops.moe_offload.*``, with their fake kernels (fakes.py).

    pip install (setup.py): csrc/cpu/ --every variant of buildinfo.VARIANTS--> kernels/_cpu_<variant>.so + STAMP
    load(): CPUID --the variant's prebuilt library, when STAMP names this torch and these sources--> loaded
            --else (an edited checkout, another torch, an install without them)--> cpp_extension.load(ISA flags)
              --> <build dir>/moe_offload_cpu_<variant>_<hash of csrc/, the flags and torch.__version__>.so

The ISA (AVX512-BF16, AVX2, or a portable loop) comes from /proc/cpuinfo; MOE_OFFLOAD_KERNELS=<variant> picks a
lesser one, MOE_OFFLOAD_KERNELS=0 turns the kernels off. The build directory is $TORCH_EXTENSIONS_DIR or
~/.cache/moe-offload/kernels (the temp dir where that is read-only), never the package: an installed wheel's
read-only csrc/ is only read. ``load()`` returns False, after one warning, when the kernels are disabled or cannot
be built; callers then keep the ``F.linear`` path, and the engine's start log, /metrics and ``selftest`` say so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from moe_offload import settings
from moe_offload.engines.offload.kernels import fakes
from moe_offload.engines.offload.kernels.buildinfo import BASE_CFLAGS, STAMP, VARIANTS, prebuilt_name
from moe_offload.engines.offload.kernels.buildinfo import source_hash as _hash_of
from moe_offload.errors import BackendUnavailable

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file only
    fcntl = None

ENV = "MOE_OFFLOAD_KERNELS"
CSRC = Path(__file__).parent / "csrc"  # shipped as package data (pyproject.toml)

_lock = threading.Lock()
_state: dict = {}  # "ok": usable now, "built": library loaded, "variant": ISA, "error": why not


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: then the portable build)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_variant(flags: set[str]) -> tuple[str, tuple[str, ...]]:
    """(variant name, compiler flags) for the best ISA these CPU flags allow; MOE_OFFLOAD_KERNELS=<name> picks a lesser one."""
    forced = settings.kernels_isa()
    usable = [(name, cflags) for name, needs, cflags in VARIANTS if set(needs) <= flags]  # never one the CPU lacks
    return next(((n, c) for n, c in usable if n == forced), usable[0])


def build_dir(name: str) -> Path:
    return settings.get("TORCH_EXTENSIONS_DIR") / name


def load() -> bool:
    """Build (first use on this machine, ~10-30 s) or load the kernels; True when ``torch.ops.moe_offload`` has them
    and they are on. Cheap after the first call (the hot path calls it per expert).

    Never raises: a missing compiler, a failed build or MOE_OFFLOAD_KERNELS=0 (read once, at the first call) give
    False (one warning for a failure), and callers keep the ``F.linear`` path.
    """
    ok = _state.get("ok")
    if ok is None:
        with _lock:
            if "ok" not in _state:
                _state.update((_prebuilt() or _build()) if not settings.kernels_off() else
                              {"ok": False, "built": False, "variant": "", "source": "", "error": f"disabled by {ENV}"})
            ok = _state["ok"]
    return ok


def set_enabled(on: bool) -> bool:
    """Turn the kernels on (building them if needed) or off for this process, e.g. for an A/B in one process.
    Returns whether they are on."""
    with _lock:
        if on and not _state.get("built"):
            _state.update(_prebuilt() or _build())
        _state["ok"] = bool(on and _state.get("built"))
        return _state["ok"]


def build() -> dict:
    """Compile this CPU's variant now and load it, whatever was built at install: what the first use does where no
    matching library was installed (an edited checkout, another torch). Returns info(). Once per process: the ops
    register once."""
    with _lock:
        _state.update(_build())
        return dict(_state)


def info() -> dict:
    """{"ok": bool, "built": bool, "variant": str, "source": "prebuilt" | "jit" | "", "error": str} once ``load()``
    ran; {} before."""
    return dict(_state)


def sources() -> list[Path]:
    """The translation units: one per op family and the bindings (csrc/cpu/*.cpp; the headers come in by #include)."""
    return sorted((CSRC / "cpu").glob("*.cpp"))


def source_hash() -> str:
    """sha256 of every file under csrc/ (buildinfo.source_hash)."""
    return _hash_of(CSRC)


def build_spec() -> tuple[str, list[str], str]:
    """(variant, compiler flags, library name) of this CPU's build. The name carries the variant and a hash of
    the sources' bytes, flags and torch version, so a cache shared by machines never hands one a library for another
    ISA, and an edited header is a new build."""
    variant, isa = pick_variant(cpu_flags())
    cflags = [*BASE_CFLAGS, *isa]
    key = hashlib.sha256("\0".join((source_hash(), *cflags, torch.__version__)).encode()).hexdigest()[:12]
    return variant, cflags, f"moe_offload_cpu_{variant}_{key}"


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One builder per build directory, across processes, and no hang on a dead builder's lock.

    torch's builder guards the directory with a ``lock`` file it deletes when done; a builder killed mid-build
    (SIGKILL, OOM, a CI timeout) leaves it behind and every later process waits on it forever. An flock is
    dropped by the kernel when its holder dies: holding it, no live process of ours is building here, so a
    leftover ``lock`` is stale and removed."""
    if fcntl is None:
        yield
        return
    with open(directory / "build.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prebuilt() -> dict | None:
    """Load the variant CPUID picks from the libraries built at install (setup.py), or None (then _build): none
    there, or their STAMP names another torch or other sources (an edited checkout: the developer's JIT build)."""
    variant = pick_variant(cpu_flags())[0]
    here = Path(__file__).parent
    libs = sorted(here.glob(prebuilt_name(variant) + ".*so"))
    try:
        stamp = json.loads((here / STAMP).read_text())
    except (OSError, ValueError):
        return None
    same_sources = stamp.get("source_hash") == source_hash()  # reads csrc/ once
    if not libs or stamp.get("torch") != torch.__version__ or not same_sources:
        from moe_offload.log import get_logger

        get_logger("moe_offload.kernels").info(
            "prebuilt kernels do not match: building", variant=variant, have=bool(libs),
            built_for=stamp.get("torch"), torch=torch.__version__, same_sources=same_sources)
        return None
    try:
        torch.ops.load_library(str(libs[0]))
    except (OSError, RuntimeError) as e:
        from moe_offload.log import get_logger

        get_logger("moe_offload.kernels").warning("prebuilt kernels do not load: building", library=str(libs[0]),
                                                  error=" ".join(str(e).split())[-300:])
        return None
    fakes.register_fakes()
    return {"ok": True, "built": True, "variant": variant, "source": "prebuilt", "error": ""}


def _build() -> dict:
    variant = pick_variant(cpu_flags())[0]
    try:
        from torch.utils.cpp_extension import load

        variant, cflags, name = build_spec()  # reads csrc/: inside the try, as a missing source is a failed build
        if not sources():
            raise BackendUnavailable(f"CPU kernels: expected the C++ sources in {CSRC / 'cpu'}, got no .cpp files")
        _find_ninja()
        directory = build_dir(name)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:  # read-only home (some CI runners, containers): build in the temp dir instead
            directory = Path(tempfile.gettempdir()) / f"moe-offload-kernels-{os.getuid()}" / name
            directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            # objects and the library go to the build directory; the sources are only read
            load(
                name=name,
                sources=[str(f) for f in sources()],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(CSRC / "cpu")],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        fakes.register_fakes()
        return {"ok": True, "built": True, "variant": variant, "source": "jit", "error": ""}
    except Exception as e:  # noqa: BLE001 - any build or load failure means: keep the F.linear path
        msg = " ".join(str(e).split())[-400:]
        from moe_offload.log import get_logger

        get_logger("moe_offload.kernels").warning(
            "cpu_kernels_unavailable", variant=variant, error=f"{type(e).__name__}: {msg}",
            fallback="F.linear", hint=f"set {ENV}=0 to skip the build",
        )
        return {"ok": False, "built": False, "variant": variant, "source": "", "error": f"{type(e).__name__}: {msg}"}


def _find_ninja() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts it next to the
    interpreter, which is not on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if shutil.which("ninja", path=d):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return
