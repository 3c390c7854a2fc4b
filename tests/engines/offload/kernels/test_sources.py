"""The kernel sources as files: the build's cache key follows their bytes, every file ships in the wheel, and the
Python side (ops.py) agrees with the C++ (bindings.cpp, quant.h). No compiler needed: nothing here builds.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import tomllib
from pathlib import Path

from moe_offload.engines.offload.kernels import fakes, jit, ops

ROOT = Path(__file__).resolve().parents[4]
CPU = jit.CSRC / "cpu"


def _files() -> list[Path]:
    return sorted(p for p in jit.CSRC.rglob("*") if p.is_file())


def test_cache_key_follows_every_source_byte(tmp_path, monkeypatch):
    # a header edited by one byte must be a new library name: torch's builder tracks only the .cpp it is given, so a
    # name that missed a header would hand back the stale library
    copy = tmp_path / "csrc"
    shutil.copytree(jit.CSRC, copy)
    monkeypatch.setattr(jit, "CSRC", copy)
    base = jit.build_spec()[2]
    assert jit.build_spec()[2] == base  # deterministic
    names = {base}
    for f in sorted(p for p in copy.rglob("*") if p.is_file()):
        data = f.read_bytes()
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one byte of one file
        names.add(jit.build_spec()[2])
        f.write_bytes(data)
    assert len(names) == len(_files()) + 1
    assert jit.build_spec()[2] == base
    (copy / "cpu" / "gemm.cpp").rename(copy / "cpu" / "gemm2.cpp")  # same bytes, another file: another build
    assert jit.build_spec()[2] != base


def test_sources_are_the_translation_units():
    assert [p.name for p in jit.sources()] == ["attention.cpp", "bindings.cpp", "decode.cpp", "deltanet.cpp", "gemm.cpp", "mla.cpp", "moe.cpp", "moe_quant.cpp", "router.cpp", "step.cpp"]


def test_every_source_file_is_package_data():
    # an installed wheel builds from its package data: a header missing there fails the build on the user's machine
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = "moe_offload.engines.offload.kernels"
    globs = cfg["package-data"][package]
    pkg_dir = ROOT / cfg["package-dir"]["moe_offload.engines"] / "offload" / "kernels"
    assert pkg_dir.resolve() == jit.CSRC.parent.resolve()
    for f in _files():
        rel = f.relative_to(pkg_dir).as_posix()
        assert any(fnmatch.fnmatchcase(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_isa_ifs_live_in_headers_only():
    # the .cpp files are ISA-neutral: each variant's code is chosen in vec.h / quant.h / attention_tiles.h
    for f in sorted(CPU.glob("*.cpp")):
        assert not re.search(r"^\s*#\s*(el)?if.*MOE_AVX", f.read_text(), re.MULTILINE), f.name


def test_every_op_has_a_schema_an_impl_and_a_fake():
    text = (CPU / "bindings.cpp").read_text()
    defs = re.findall(r'm\.def\("(\w+)\(', text)
    impls = re.findall(r'm\.impl\("(\w+)"', text)
    assert len(defs) == len(set(defs)) and sorted(defs) == sorted(impls) == sorted(fakes.FAKES)


def test_max_tokens_is_the_kernels_max_n():
    m = re.search(r"constexpr int64_t MAX_N = (\d+);", (CPU / "quant.h").read_text())
    assert m and int(m[1]) == ops.MAX_TOKENS



def test_block_sizes_are_the_vocabularys():
    # The C++ dequantizes with its own constants; the store, spec and cost model count bytes with vocab's.
    from moe_offload.control import vocab

    text = (CPU / "quant.h").read_text()
    fb = re.search(r"constexpr int64_t FB = (\d+);", text)
    mb = re.search(r"constexpr int64_t MB = (\d+);", text)
    assert fb and int(fb[1]) == vocab.FP8_BLOCK
    assert mb and int(mb[1]) == vocab.MX_BLOCK


def test_the_kernels_built_at_install_are_the_ones_loaded(monkeypatch):
    # setup.py compiled every ISA variant at install and stamped them with the torch and the sources they were built
    # from: a missing stamp is an install without kernels (pip's build isolation, no torch at build time)
    import json

    import torch

    from moe_offload.engines.offload.kernels.buildinfo import STAMP, prebuilt_name

    here = Path(jit.__file__).parent
    stamp = json.loads((here / STAMP).read_text())
    assert stamp["variants"] == [v[0] for v in jit.VARIANTS]
    assert all(list(here.glob(prebuilt_name(v) + ".*so")) for v in stamp["variants"])
    if stamp["torch"] == torch.__version__ and stamp["source_hash"] == jit.source_hash():
        assert jit.load() and jit.info()["source"] == "prebuilt", jit.info()
    # other sources (an edited checkout) or another torch: not those libraries, the build at first use instead
    monkeypatch.setattr(jit, "source_hash", lambda: "0" * 64)
    assert jit._prebuilt() is None
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert jit._prebuilt() is None
