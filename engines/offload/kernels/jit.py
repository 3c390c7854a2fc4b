"""The loader of the CPU kernels: builds csrc/cpu/ for this CPU's ISA at first use, loads the library (its ops
register as ``torch.ops.moe_offload.*``) and their fake kernels (ops.py).

    csrc/cpu/*.cpp + *.h --cpp_extension.load(ISA flags)--> <build dir>/<name>.so --> torch.ops.moe_offload
    name = moe_offload_cpu_<variant>_<hash of every file under csrc/, the flags and torch.__version__>

The ISA (AVX512-BF16, AVX2, or a portable loop) comes from /proc/cpuinfo; MOE_OFFLOAD_KERNELS=<variant> picks a
lesser one, MOE_OFFLOAD_KERNELS=0 turns the kernels off. The build directory is $TORCH_EXTENSIONS_DIR or
~/.cache/moe-offload/kernels (the temp dir where that is read-only), never the package: an installed wheel's
read-only csrc/ is only read. ``load()`` builds once per machine and returns False, after one warning, when the
kernels are disabled or cannot be built; callers then keep the ``F.linear`` path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from moe_offload import settings
from moe_offload.engines.offload.kernels import ops
from moe_offload.errors import BackendUnavailable

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock file only
    fcntl = None

ENV = "MOE_OFFLOAD_KERNELS"
CSRC = Path(__file__).parent / "csrc"  # shipped as package data (pyproject.toml)

# ISA variants, best first: (name, /proc/cpuinfo flags it needs, compiler flags)
VARIANTS = (
    # every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) also has VNNI, which the int8 kernels use
    ("avx512bf16", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c"),
     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c", "-DMOE_AVX512BF16")),
    ("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-DMOE_AVX2")),
    ("portable", (), ()),
)

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


def enabled_by_env() -> bool:
    return not settings.kernels_off()


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
                _state.update(_build() if enabled_by_env() else {"ok": False, "built": False, "variant": "",
                                                                  "error": f"disabled by {ENV}"})
            ok = _state["ok"]
    return ok


def set_enabled(on: bool) -> bool:
    """Turn the kernels on (building them if needed) or off for this process, e.g. for an A/B in one process.
    Returns whether they are on."""
    with _lock:
        if on and not _state.get("built"):
            _state.update(_build())
        _state["ok"] = bool(on and _state.get("built"))
        return _state["ok"]


def info() -> dict:
    """{"ok": bool, "built": bool, "variant": str, "error": str} once ``load()`` ran; {} before."""
    return dict(_state)


def sources() -> list[Path]:
    """The translation units: one per op family and the bindings (csrc/cpu/*.cpp; the headers come in by #include)."""
    return sorted((CSRC / "cpu").glob("*.cpp"))


def source_hash() -> str:
    """sha256 of every file under csrc/ (headers and .clang-format included), path and bytes, in path order."""
    h = hashlib.sha256()
    for f in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        h.update(f.relative_to(CSRC).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def build_spec() -> tuple[str, list[str], str]:
    """(variant, compiler flags, library name) of this CPU's build. The name carries the variant and a hash of
    the sources' bytes, flags and torch version, so a cache shared by machines never hands one a library for another
    ISA, and an edited header is a new build."""
    variant, isa = pick_variant(cpu_flags())
    # -fopenmp: at::parallel_for is an inline OpenMP region; without it the kernel would run on one thread.
    # The library then needs libgomp.so.1, which resolves to the copy torch already loaded (one thread pool).
    cflags = ["-O3", "-fopenmp", *isa]
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
        ops.register_fakes()
        return {"ok": True, "built": True, "variant": variant, "error": ""}
    except Exception as e:  # noqa: BLE001 - any build or load failure means: keep the F.linear path
        msg = " ".join(str(e).split())[-400:]
        from moe_offload.log import get_logger

        get_logger("moe_offload.kernels").warning(
            "cpu_kernels_unavailable", variant=variant, error=f"{type(e).__name__}: {msg}",
            fallback="F.linear", hint=f"set {ENV}=0 to skip the build",
        )
        return {"ok": False, "built": False, "variant": variant, "error": f"{type(e).__name__}: {msg}"}


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
