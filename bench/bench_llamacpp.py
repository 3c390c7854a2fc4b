"""llama.cpp beside this engine (issue 12): single-stream decode ms/token, interleaved in one run, as ratios.

    python bench/bench_llamacpp.py --model-dir /tmp/benchmodel     # full: 64 decode tokens, 128-token context, 3 rounds
    python bench/bench_llamacpp.py --quick                         # proves the pipeline: tiny model, 4 tokens, 1 round
    python bench/bench_llamacpp.py --build-only                    # build llama.cpp into the cache and stop

    llama-cpp-python sdist (PyPI, `pip download`) --extract vendor/llama.cpp--> cmake: llama-bench, llama-batched-bench
    HF checkpoint (+ the demo tokenizer when it has none) --convert_hf_to_gguf.py--> GGUF bf16, q8_0
    rounds x [llama-bench bf16 | llama-bench q8_0 | engine fraction 1.0 | engine fraction 0.25 static] --> table

Everything built or converted lives in a cache outside the repository (default ~/.cache/moe-offload/llama.cpp,
or $MOE_OFFLOAD_LLAMACPP_DIR), reused when present: the first run compiles for several minutes. Both sides run
2 threads (--threads). The engine runs in this process through the engine API (`build_offload_engine`, as
`moe-offload generate` does), warm, after a prompt of --context tokens; llama-bench decodes after a prefilled
depth of the same length (`-d`). Not part of CI. Reusable from other bench scripts:

    from bench_llamacpp import ensure_llamacpp, to_gguf, llama_bench, batched_bench
    tools = ensure_llamacpp()
    gguf = to_gguf(model_dir, "bf16")
    rows = batched_bench(gguf, [1, 4, 8, 16], tokens=64)   # one dict per parallel-sequence count
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moe_offload import settings

CACHE = settings.get("MOE_OFFLOAD_LLAMACPP_DIR")
VERSION = "0.3.36"  # the llama-cpp-python release the issue measured with; --llama-version changes it
TARGETS = ("llama-bench", "llama-batched-bench")
OUTTYPES = ("bf16", "q8_0", "f16", "f32")
# CMake options: only the CPU backend, no network (no OpenSSL/curl), static so the binaries move with the cache.
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF")
# llama.cpp for a narrower ISA than the host's, to compare with this engine's kernels of that ISA
# (MOE_OFFLOAD_KERNELS=avx2) on a host that has more: the AVX2 build a Zen 2/3 or Xeon E5 v4 host runs natively.
ISA_OPTIONS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AVX_VNNI=OFF"),
}
# what caps this engine (its kernels) and torch (ATen's dispatch, oneDNN, MKL) at that ISA: read at import
ISA_ENV = {"avx2": {"MOE_OFFLOAD_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
# The demo tokenizer is byte-level BPE with the GPT-2 split regex (tokenizers' ByteLevel(use_regex=True)), which
# the converter does not know by its hash: llama.cpp's "gpt-2" pre-tokenizer applies the same regex.
DEFAULT_PRE = "gpt-2"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure raise with the command and the tail of its output (a build log can be long)."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + "\n" + r.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"command failed (exit {r.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return r


# ---- build ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (for convert_hf_to_gguf.py) and the two benchmark binaries."""

    version: str
    src: Path
    bench: Path
    batched_bench: Path

    @property
    def convert(self) -> Path:
        return self.src / "convert_hf_to_gguf.py"


# llama-batched-bench prints its results through llama.cpp's log thread, which is not flushed at exit (upstream
# issue 22142): on a busy machine its last result lines get lost. The patch stops that thread, flushing it, before
# the tool returns; nothing else changes. Its name goes into the build stamp, so an older build is redone.
PATCH = ("tools/batched-bench/batched-bench.cpp", "    llama_backend_free();\n\n    return 0;\n}",
         "    llama_backend_free();\n\n    common_log_pause(common_log_main()); // moe-offload: flush the results\n\n"
         "    return 0;\n}")
STAMP = "moe-offload-build-1 batched-bench-log-flush"


def ensure_llamacpp(cache: Path = CACHE, version: str = VERSION, jobs: int = 2, isa: str = "native") -> LlamaCpp:
    """llama.cpp's llama-bench and llama-batched-bench, built from the llama-cpp-python ``version`` sdist into
    ``cache`` (reused when built there before) for ``isa`` (ISA_OPTIONS: the host's, or AVX2 only). Builds at
    ``nice -n 10`` with ``jobs`` compile jobs."""
    if isa not in ISA_OPTIONS:
        raise ValueError(f"isa: expected one of {', '.join(ISA_OPTIONS)}, got {isa!r}")
    root = Path(cache).expanduser() / f"llama-cpp-python-{version}"
    src, build = root / "src", root / ("build" if isa == "native" else f"build-{isa}")
    bins = [build / "bin" / t for t in TARGETS]
    stamp = build / "moe-offload.stamp"
    built = all(b.is_file() and os.access(b, os.X_OK) for b in bins)
    if built and stamp.is_file() and stamp.read_text().strip() == STAMP and (src / "convert_hf_to_gguf.py").is_file():
        return LlamaCpp(version, src, *bins)
    missing_tools = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing_tools:
        raise RuntimeError(f"building llama.cpp needs {' and '.join(missing_tools)} on PATH "
                           "(Debian: apt-get install cmake g++)")
    root.mkdir(parents=True, exist_ok=True)
    if not (src / "CMakeLists.txt").is_file():
        _extract_vendor(root, version, src)
    _patch(src)
    t0 = time.perf_counter()
    log(f"configuring llama.cpp {version} ({isa}) in {build}")
    _run(["cmake", "-S", src, "-B", build, *CMAKE_OPTIONS, *ISA_OPTIONS[isa]])
    log(f"building {', '.join(TARGETS)} with {jobs} jobs (several minutes on 2 cores)")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    _run([*nice, "cmake", "--build", build, "--target", *TARGETS, "-j", str(jobs)])
    missing = [b for b in bins if not b.is_file()]
    if missing:
        raise RuntimeError(f"llama.cpp build finished without {', '.join(map(str, missing))}")
    stamp.write_text(STAMP + "\n")
    log(f"built llama.cpp in {time.perf_counter() - t0:.0f} s")
    return LlamaCpp(version, src, *bins)


def as_isa(isa: str) -> None:
    """Run this process as a host of ``isa`` would: with ISA_ENV[isa] set (re-executing the script once, as torch reads
    them at import), so the engine's kernels, torch's and llama.cpp's (ensure_llamacpp(isa=...)) are all that ISA's."""
    env = ISA_ENV.get(isa, {})
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.environ.update(env)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def _patch(src: Path) -> None:
    rel, old, new = PATCH
    f = src / rel
    text = f.read_text()
    if new in text:
        return
    if old not in text:  # another llama.cpp version: batched_bench() then reruns sizes whose lines went missing
        log(f"note: {rel} differs from the expected source; its output is not flushed at exit")
        return
    f.write_text(text.replace(old, new, 1))


def _extract_vendor(root: Path, version: str, src: Path) -> None:
    """Download the sdist with pip (PyPI's ordinary client) and unpack its vendor/llama.cpp into ``src``."""
    sdist_dir = root / "sdist"
    sdist_dir.mkdir(exist_ok=True)
    found = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        log(f"downloading the llama-cpp-python {version} sdist from PyPI")
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", sdist_dir])
        found = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python-*.tar.gz in {sdist_dir}")
    prefix = None
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
    try:
        with tarfile.open(found[-1]) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/")
                if len(parts) > 2 and parts[1:3] == ["vendor", "llama.cpp"]:
                    prefix = prefix or "/".join(parts[:3])
                    members.append(m)
            if not members:
                raise RuntimeError(f"{found[-1]} has no vendor/llama.cpp")
            tar.extractall(tmp, members=members, filter="data")
        if src.exists():
            shutil.rmtree(src)
        os.replace(tmp / prefix, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- convert ----------------------------------------------------------------------------------------------

# Runs convert_hf_to_gguf.py's main() with the BPE pre-tokenizer check falling back to a named pre-tokenizer
# when the tokenizer's hash is unknown (a locally trained tokenizer always is), and GLM's vocabulary step (which
# looks up GLM's own special tokens by name) falling back to the plain GPT-2 BPE vocabulary when the tokenizer
# lacks them; and the SentencePiece step (Llama/Mixtral) reporting the missing tokenizer.model as the file it
# lacks (its fallback to the BPE vocabulary) without needing the sentencepiece package. Argument 1: the
# pre-tokenizer.
_CONVERT = r"""# written by moe-offload's bench/bench_llamacpp.py: convert_hf_to_gguf.py with a pre-tokenizer fallback
import os, runpy, sys

pre, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
here = os.path.dirname(os.path.abspath(script))
sys.path[:0] = [here, os.path.join(here, "gguf-py")]
from conversion import base

original = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        print(f"pre-tokenizer not recognised by its hash: mapped to {pre!r}", file=sys.stderr)
        return pre


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
original_glm = base.TextModel._set_vocab_glm


def set_vocab_glm(self):
    from transformers import AutoTokenizer

    if "[gMASK]" in AutoTokenizer.from_pretrained(self.dir_model).get_added_vocab():
        return original_glm(self)
    print("tokenizer without GLM's special tokens: plain BPE vocabulary", file=sys.stderr)
    return self._set_vocab_gpt2()


base.TextModel._set_vocab_glm = set_vocab_glm
original_sp = base.TextModel._set_vocab_sentencepiece


def set_vocab_sentencepiece(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return original_sp(self, *args, **kwargs)


base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
from conversion import ernie

original_ernie = ernie.Ernie4_5Model.set_vocab


def set_vocab_ernie(self):  # Ernie 4.5 reads only a SentencePiece model; a locally trained BPE tokenizer has none
    if (self.dir_model / "tokenizer.model").is_file():
        return original_ernie(self)
    print("no tokenizer.model: plain BPE vocabulary", file=sys.stderr)
    return self._set_vocab_gpt2()


ernie.Ernie4_5Model.set_vocab = set_vocab_ernie
runpy.run_path(script, run_name="__main__")
"""


def _model_key(model_dir: Path) -> str:
    """Identity of a checkpoint for the GGUF cache: config.json's bytes, every weight file's name and size, and its
    first and last MiB (cheap, and enough to tell apart two checkpoints of one shape)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:12]


def _staged(model_dir: Path, stage: Path) -> Path:
    """``model_dir`` as the converter needs it: its files linked, plus the demo tokenizer when it has none
    (the benchmark model has none; the converter pads the vocabulary up to config.vocab_size)."""
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return model_dir
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            (stage / f.name).symlink_to(f.resolve())
    from moe_offload.demo import build_tokenizer

    build_tokenizer().save_pretrained(stage)
    return stage


def to_gguf(model_dir, outtype: str = "bf16", *, cache: Path = CACHE, tools: LlamaCpp | None = None,
            pre: str = DEFAULT_PRE) -> Path:
    """The GGUF of the HF checkpoint ``model_dir`` in ``outtype`` (bf16 | q8_0 | f16 | f32), converted once
    into ``cache``/gguf and reused. ``pre``: llama.cpp pre-tokenizer used when the converter does not know the
    tokenizer's hash."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: expected one of {', '.join(OUTTYPES)}, got {outtype!r}")
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    tools = tools or ensure_llamacpp(cache)
    key = _model_key(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "model")
    out = Path(cache).expanduser() / "gguf" / f"{model_type}-{key}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = _staged(model_dir, Path(cache).expanduser() / "stage" / key)
    tmp = out.with_suffix(".part")
    t0 = time.perf_counter()
    log(f"converting {model_dir} to GGUF {outtype}")
    wrapper = tools.src.parent / "convert_mapped.py"
    if not wrapper.is_file() or wrapper.read_text() != _CONVERT:
        wrapper.write_text(_CONVERT)
    # Qwen3-Next's converter expects the release's multi-token-prediction layers unless told there are none
    extra = ["--no-mtp"] if model_type == "qwen3_next" else []
    _run([sys.executable, wrapper, pre, tools.convert, stage, "--outtype", outtype, "--outfile", tmp, *extra])
    os.replace(tmp, out)
    log(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    return out


# ---- llama.cpp benchmarks ---------------------------------------------------------------------------------


def llama_bench(gguf, tokens: int, *, depth: int = 0, threads: int = 2, repetitions: int = 1,
                tools: LlamaCpp | None = None, cache: Path = CACHE, extra=()) -> dict:
    """llama-bench text generation of ``tokens`` tokens after ``depth`` tokens of context, ``threads`` threads
    (``extra``: more llama-bench arguments, e.g. the KV cache's types).
    Returns {"ms_per_token": [one per repetition], "tok_s", "raw": llama-bench's JSON record}."""
    tools = tools or ensure_llamacpp(cache)
    cmd = [tools.bench, "-m", gguf, "-p", "0", "-n", tokens, "-t", threads, "-r", repetitions, "-o", "json"]
    if depth:
        cmd += ["-d", depth]
    r = _run([*cmd, *extra])
    records = json.loads(r.stdout)
    tg = [x for x in records if x.get("n_gen", 0) > 0]
    if not tg:
        raise RuntimeError(f"llama-bench printed no text-generation record: {r.stdout[:500]}")
    rec = tg[0]
    ms = [ns / 1e6 / rec["n_gen"] for ns in rec.get("samples_ns") or []] or [1000 / rec["avg_ts"]]
    return {"ms_per_token": ms, "tok_s": rec["avg_ts"], "raw": rec}


def llama_prefill(gguf, n: int, *, threads: int = 2, tools: LlamaCpp | None = None, cache: Path = CACHE) -> float:
    """llama-bench prompt processing of ``n`` tokens (``-p n -n 0``): tok/s."""
    tools = tools or ensure_llamacpp(cache)
    r = _run([tools.bench, "-m", gguf, "-p", n, "-n", "0", "-t", threads, "-r", "1", "-o", "json"])
    pp = [x for x in json.loads(r.stdout) if x.get("n_prompt", 0) > 0 and x.get("n_gen", 0) == 0]
    if not pp:
        raise RuntimeError(f"llama-bench printed no prompt-processing record: {r.stdout[:500]}")
    return float(pp[0]["avg_ts"])


def batched_bench(gguf, batch_sizes, tokens: int, *, prompt: int = 128, threads: int = 2,
                  tools: LlamaCpp | None = None, cache: Path = CACHE) -> list[dict]:
    """llama-batched-bench: one run per entry of ``batch_sizes``, that many parallel sequences of ``prompt``
    prompt tokens and ``tokens`` generated tokens each, ``threads`` threads. One dict per run, in the order given,
    with llama.cpp's fields: ``pl`` (sequences), ``speed_tg`` (aggregate decode tok/s), ``speed_pp``, ``t_tg`` (s)..."""
    tools = tools or ensure_llamacpp(cache)
    sizes = [int(b) for b in batch_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch_sizes: expected integers >= 1, got {batch_sizes!r}")
    found: dict[int, dict] = {}
    for _ in range(3):  # an unpatched build can lose its last lines at exit: rerun what is missing
        todo = [b for b in sizes if b not in found]
        if not todo:
            break
        # llama.cpp gives each sequence an equal slice of the context, rounded to 256 cells
        per_seq = -(-(prompt + tokens + 1) // 256) * 256
        cmd = [tools.batched_bench, "-m", gguf, "-c", per_seq * max(todo), "-b", 2048, "-ub", 512, "-npp", prompt,
               "-ntg", tokens, "-npl", ",".join(map(str, todo)), "-t", threads, "--output-format", "jsonl"]
        out = _run(cmd).stdout
        for line in out.splitlines():
            if line.startswith("{") and '"pl"' in line:
                row = json.loads(line)
                found[int(row["pl"])] = row
    missing = [b for b in sizes if b not in found]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no result for {missing} parallel sequences")
    return [found[b] for b in sizes]


# ---- this engine ------------------------------------------------------------------------------------------


def engine_decode(engine, prompt: list[int], tokens: int) -> list[float]:
    """ms of each of ``tokens`` decode steps of ``engine`` (greedy, after a prefill of ``prompt``)."""
    from moe_offload.engines.params import SamplingParams

    gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    for _ in gen:
        pass
    return list(gen.stats.token_ms)


def engine_prefill(engine, prompt: list[int]) -> float:
    """tok/s of the engine's prefill of ``prompt`` (its first step's chunks up to the first token)."""
    from moe_offload.engines.params import SamplingParams

    gen = engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in gen:
        pass
    return len(prompt) / gen.stats.prefill_ms * 1000


def prefill_side_by_side(path: Path, tools: LlamaCpp, n: int, rounds: int, threads: int, cache: Path) -> dict:
    """Prompt processing of ``n`` tokens, llama.cpp bf16 and this engine (bf16, every expert resident), interleaved
    per round: tok/s per round."""
    import torch
    from bench_engine import prompt_ids

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    gguf = to_gguf(path, "bf16", cache=cache, tools=tools)
    torch.set_num_threads(threads)
    vocab = ModelSpec.from_hf_config(path).vocab_size
    from moe_offload.engines.offload.kernels import gemm

    e = build_offload_engine(path, policy="static", fraction=1.0, dtype="bfloat16", max_num_batched_tokens=max(512, n))
    tiles = gemm.fp32_tiles()  # this CPU's prefill path (kernels/gemm.py)
    try:
        engine_prefill(e, prompt_ids(16, vocab))  # warm-up
        runs: dict[str, list[float]] = {}
        for r in range(rounds):
            runs.setdefault("llama.cpp llama-bench bf16", []).append(llama_prefill(gguf, n, threads=threads, tools=tools))
            prompt = [(t + r) % vocab for t in prompt_ids(n, vocab)]  # another prompt each round: no cached prefix
            runs.setdefault("moe-offload bf16, fraction 1", []).append(engine_prefill(e, prompt))
            if tiles:  # A/B in the same round: the prefill GEMMs in torch's bf16 instead of fp32 tiles
                gemm.set_fp32_tiles(False)
                try:
                    runs.setdefault("moe-offload bf16, fraction 1, torch bf16 GEMM", []).append(engine_prefill(e, prompt))
                finally:
                    gemm.set_fp32_tiles(None)
            log(f"prefill round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in runs.items()))
        return runs
    finally:
        e.close()


def bound_bytes(model_dir) -> int:
    """Bytes one decode token must read (the cost model's count): every non-expert weight but the embedding
    table (one row), plus top-k experts per MoE layer."""
    from moe_offload.control.spec import ModelSpec

    s = ModelSpec.from_hf_config(model_dir)
    return s.dense_bytes + s.lm_head_bytes + s.hidden_size * s.dtype_bytes + s.num_moe_layers * s.top_k * s.expert_bytes


# ---- the side-by-side -------------------------------------------------------------------------------------

QUICK_SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                   vocab_size=2048, max_position_embeddings=512)


def side_by_side(path: Path, tools: LlamaCpp, outtypes, fractions, tokens: int, context: int, rounds: int,
                 threads: int, cache: Path, expert_dtypes=("bf16",)) -> dict[str, list[float]]:
    """Mean ms/token of each configuration in each round; the configurations alternate within a round, so all
    see the same background load."""
    import torch
    from bench_engine import prompt_ids

    from moe_offload.control.spec import ModelSpec
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    ggufs = {t: to_gguf(path, t, cache=cache, tools=tools) for t in outtypes}
    torch.set_num_threads(threads)
    prompt = prompt_ids(context, ModelSpec.from_hf_config(path).vocab_size)
    engines = {}
    try:
        for x in expert_dtypes:  # "int8", or "int8+dense": --expert-dtype int8 --dense-dtype int8
            ed, *more = x.split("+")
            for f in fractions:
                e = build_offload_engine(path, policy="static", fraction=f, dtype="bfloat16",
                                         expert_dtype=None if ed == "bf16" else ed,
                                         dense_dtype="int8" if "dense" in more else None)
                engines[f"moe-offload {x}, fraction {f:g}, static"] = e
                engine_decode(e, prompt, 2)  # warm-up (llama-bench warms up by itself)
        runs: dict[str, list[float]] = {}
        for r in range(rounds):
            for t, g in ggufs.items():
                ms = llama_bench(g, tokens, depth=context, threads=threads, tools=tools)["ms_per_token"]
                runs.setdefault(f"llama.cpp llama-bench {t}", []).append(statistics.fmean(ms))
            for name, e in engines.items():
                ms = engine_decode(e, prompt, tokens)
                runs.setdefault(name, []).append(statistics.fmean(ms))
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()))
        return runs
    finally:
        for e in engines.values():
            e.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 decode tokens, 8-token context, 1 round")
    ap.add_argument("--model-dir", type=Path, help="the benchmark model here (built if absent) instead of a temp dir")
    ap.add_argument("--tokens", type=int, help="decode tokens per measurement (default 64; quick 4)")
    ap.add_argument("--context", type=int, help="tokens in the KV cache before decoding (default 128; quick 8)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    ap.add_argument("--outtypes", default="bf16,q8_0", help="GGUF types for llama.cpp (default bf16,q8_0)")
    ap.add_argument("--fractions", default="1.0,0.25", help="engine resident fractions, static policy (default 1.0,0.25)")
    ap.add_argument("--expert-dtypes", default="bf16",
                    help="engine expert formats, e.g. bf16,int8 (--expert-dtype); int8+dense adds --dense-dtype int8")
    ap.add_argument("--batched", default="", help="also run llama-batched-bench bf16 at these parallel sequences (1,4,8,16)")
    ap.add_argument("--cache", type=Path, default=CACHE, help=f"build and GGUF cache (default {CACHE})")
    ap.add_argument("--llama-version", default=VERSION, help=f"llama-cpp-python sdist version (default {VERSION})")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs for the first build (default 2)")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp (and convert --model-dir if given), then stop")
    ap.add_argument("--isa", choices=tuple(ISA_OPTIONS), default="native",
                    help="avx2: llama.cpp built for AVX2 only and this engine's avx2 kernels (torch capped likewise), "
                         "as on an AVX2-only host (default: the host's best on both sides)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also compare prompt processing of N tokens (llama-bench -p N) with the engine's prefill")
    args = ap.parse_args(argv)
    as_isa(args.isa)
    tokens = args.tokens or (4 if args.quick else 64)
    context = args.context or (8 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    outtypes = [t for t in args.outtypes.split(",") if t]
    fractions = [float(f) for f in args.fractions.split(",") if f]

    tools = ensure_llamacpp(args.cache, args.llama_version, args.jobs, isa=args.isa)
    if args.build_only and not args.model_dir:
        print(f"llama.cpp {tools.version}: {tools.bench}, {tools.batched_bench}")
        return 0
    from transformers.utils import logging

    logging.disable_progress_bar()
    from bench_engine import SHAPE, build_model, read_bandwidth

    from moe_offload.engines.offload.tools.calibrate import cpu_name

    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        path = build_model(args.model_dir or Path(tmp), shape=QUICK_SHAPE if args.quick else SHAPE)
        if args.build_only:
            for t in outtypes:
                print(to_gguf(path, t, cache=args.cache, tools=tools))
            return 0
        runs = side_by_side(path, tools, outtypes, fractions, tokens, context, rounds, args.threads, args.cache,
                            tuple(x for x in args.expert_dtypes.split(",") if x))
        batched = []
        if args.batched:
            sizes = [int(b) for b in args.batched.split(",") if b]
            batched = batched_bench(to_gguf(path, "bf16", cache=args.cache, tools=tools), sizes, tokens,
                                    prompt=context, threads=args.threads, tools=tools)
        prefill = prefill_side_by_side(path, tools, args.prefill, rounds, args.threads, args.cache) if args.prefill else {}
        bw = read_bandwidth()
        nbytes = bound_bytes(path)

    import torch

    from moe_offload.engines.offload.kernels import gemm, jit

    cmd = "python bench/bench_llamacpp.py" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    print(f"Command: `{cmd}`  ")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, llama.cpp from llama-cpp-python "
          f"{tools.version} ({args.isa} build), {args.threads} threads on both sides, kernels "
          f"{jit.info().get('variant') or 'off'}, "
          f"prefill GEMM {'fp32 tiles' if gemm.fp32_tiles() else 'torch bf16'}  ")
    print(f"{tokens} decode tokens after {context} tokens of context, {rounds} interleaved round(s); ms/token = mean over "
          f"the tokens of one measurement.  ")
    bound = nbytes / bw * 1000
    print(f"Bandwidth bound: {nbytes / 1e6:.0f} MB read per decode token / {bw / 1e9:.1f} GB/s measured = "
          f"**{bound:.1f} ms/token**\n")
    ref_key = next((k for k in runs if k.endswith(" bf16")), next(iter(runs)))
    ref = statistics.median(runs[ref_key])
    print(f"| configuration | ms/token per round | median | of bound | / {ref_key.removeprefix('llama.cpp llama-bench ')} llama.cpp |")
    print("|---|---|---:|---:|---:|")
    for k, v in runs.items():
        m = statistics.median(v)
        print(f"| {k} | {' / '.join(f'{x:.2f}' for x in v)} | {m:.2f} | {bound / m:.0%} | {m / ref:.2f} |")
    print(f"\nThe last column is ms/token over {ref_key}'s median: <= 1.00 is as fast or faster.")
    if prefill:
        print(f"\nPrompt processing, {args.prefill} tokens (tok/s, higher is faster; interleaved rounds):\n")
        print("| configuration | tok/s per round | median | / llama.cpp |")
        print("|---|---|---:|---:|")
        pref = statistics.median(prefill["llama.cpp llama-bench bf16"])
        for k, v in prefill.items():
            print(f"| {k} | {' / '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} | "
                  f"{statistics.median(v) / pref:.2f} |")
    if batched:
        print("\nllama-batched-bench, bf16 (aggregate decode tok/s over parallel sequences):\n")
        print("| parallel sequences | decode tok/s | vs 1 sequence |")
        print("|---:|---:|---:|")
        one = batched[0]["speed_tg"]
        for row in batched:
            print(f"| {row['pl']} | {row['speed_tg']:.1f} | {row['speed_tg'] / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
