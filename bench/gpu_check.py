"""GPU check for the offload executor: exactness with device=cuda, then a short speed check. One line per check.

    python bench/gpu_check.py                 # on a machine with a CUDA GPU
    python bench/gpu_check.py --device cpu --layers 2 --tokens 8   # dry run of the same script on the CPU

Exactness: the tiny-model policy x fraction runs, the family tests of tests/engines/offload/test_exactness.py and
the quantized releases of tests/engines/offload/loading/test_quantized.py (MXFP4, FP8 against transformers' dequantized load;
pytest -k cuda); the engine's decode paths (steps captured as CUDA graphs, model/capture.py; the owned graph run
eagerly; transformers' modules) against the CPU engine. Speed: a Qwen3-MoE-shaped random bf16 model (64 experts,
hidden 1024, I 512, top-8; 16 layers by default): the engine's three paths (ms/token, kernel launches a token), then
stock transformers (its profile with --profile).
With two GPUs (or the CPU dry run): --devices over both and --tensor-parallel 2 (NCCL ranks), each exact against
one device, hits on each device and rank. Exit status 1 if
any check failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def line(status: str, name: str, detail: str) -> None:
    print(f"{status} {name:28} {detail}", flush=True)


def check_device(device: str) -> str:
    if device.startswith("cuda"):
        assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return f"{torch.cuda.get_device_name(torch.device(device))}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
    return f"cpu, {torch.get_num_threads()} threads"


def check_tiny_exactness(device: str) -> str:
    from moe_offload.engines.offload.tools.selfcheck import exactness

    return exactness(device, tokens=16, fractions=(0.0, 0.25, 0.5, 1.0))


def check_family_tests(device: str) -> str:
    select = "cuda" if device.startswith("cuda") else "cpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-k", select, os.path.join(ROOT, "tests/engines/offload/test_exactness.py"),
           os.path.join(ROOT, "tests/engines/offload/loading/test_quantized.py")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (r.stdout.strip().splitlines() or ["no output"])[-1]
    assert r.returncode == 0, tail + "\n" + r.stdout[-3000:]
    return tail


def check_two_devices(device: str) -> str:
    """--devices over two GPUs (cpu,cpu in a dry run): greedy tokens equal the one-device run's for static, lru and
    hybrid at fraction 0.5, and both devices serve hits."""
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.offload.tools.selfcheck import tiny_checkpoint
    from moe_offload.engines.params import SamplingParams

    if device.startswith("cuda"):
        assert torch.cuda.device_count() >= 2, f"{torch.cuda.device_count()} GPU(s): this check needs two"
        pair = "cuda:0,cuda:1"
    else:
        pair = "cpu,cpu"
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(tmp)
        for policy in ("static", "lru", "hybrid"):
            runs = {}
            for devices in (None, pair):
                e = build_offload_engine(path, device=device.split(",")[0], devices=devices, policy=policy,
                                         fraction=0.5, dtype="float32")
                g = e.generate(list(range(3, 19)), SamplingParams(max_tokens=16, ignore_eos=True))
                runs[devices] = (list(g), dict(g.stats.tier_hits))
                e.close()
            assert runs[None][0] == runs[pair][0], f"{policy}: tokens differ with {pair}"
            per = runs[pair][1]
            assert len(per) == 2 and all(v > 0 for v in per.values()) or policy == "lru", f"{policy}: hits {per}"
            out.append(f"{policy} {per}")
        # --tensor-parallel 2: NCCL ranks on two GPUs (gloo ranks in the dry run), the one-process tokens
        e = build_offload_engine(path, device=device.split(",")[0], tensor_parallel=2, fraction=0.5, dtype="float32")
        tp = list(e.generate(list(range(3, 19)), SamplingParams(max_tokens=16, ignore_eos=True)))
        ranks = [r["hits"] + r["misses"] for r in e.stats()["ranks"]]
        e.close()
        assert tp == runs[None][0], "--tensor-parallel 2: tokens differ from one process"
    return f"{pair} = one device; hits per device: " + "; ".join(out) + f"; --tensor-parallel 2 = one process, pairs per rank {ranks}"


def bench_checkpoint(root: str, layers: int) -> str:
    """The engine benchmark's model shape (bench_engine.SHAPE) with ``layers`` layers."""
    from bench_engine import SHAPE, build_model

    return str(build_model(Path(root), shape={**SHAPE, "num_hidden_layers": layers}))


@torch.no_grad()
def decode_ms(model, device: str, tokens: int) -> float:
    from transformers import DynamicCache

    # warm-up: a 256-token prefill touches (pages in, caches) nearly every expert before anything is timed
    model(torch.arange(1, 257, device=device).unsqueeze(0))
    cache = DynamicCache(config=model.config)
    x = torch.arange(1, 33, device=device).unsqueeze(0)
    x = model(x, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for i in range(tokens + 8):  # the first 8 steps warm kernels and allocators up and are not counted
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        x = model(x, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        int(x)  # sync
        if i >= 8:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1000


@torch.no_grad()
def print_profile(model, device: str, steps: int = 8) -> None:
    """torch.profiler over ``steps`` decode steps: the busiest ops by host time and the device's busy time against the
    wall time (a launch-bound step shows a device far less busy than the wall)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    x = model(torch.arange(1, 33, device=device).unsqueeze(0), past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            x = model(x, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            int(x)
    wall = (time.perf_counter() - t) / steps * 1000
    ev = prof.key_averages()
    dev = sum(e.self_device_time_total for e in ev) / steps / 1000 if device.startswith("cuda") else 0.0
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")) / steps
    print(f"profile: {wall:.2f} ms/token with the profiler on, device busy {dev:.2f} ms/token, "
          f"{launches:.0f} kernel launches/token", flush=True)
    print(ev.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40), flush=True)


ENGINE_MODES = ("captured", "graph", "modules")  # decode steps replayed | the owned graph eagerly | transformers' modules


def _engine(path: str, device: str, mode: str, dtype: str, **kw):
    from moe_offload.engines.offload.runtime.build import build_offload_engine

    e = build_offload_engine(path, device=device, dtype=dtype, **kw)
    if mode != "captured":
        e.runner.capture = None
    if mode == "modules":
        e.runner.graph = None
    return e


def check_engine_exactness(device: str) -> str:
    """The engine's decode paths on ``device`` (captured pieces, the graph eagerly, the modules) against the CPU
    engine: greedy tokens equal, fp32 tiny model, every policy at fractions 0.25 / 0.5 / 1.0, three sequences."""
    from moe_offload.engines.offload.tools.selfcheck import tiny_checkpoint
    from moe_offload.engines.params import SamplingParams

    prompts = [list(range(3, 19)), list(range(30, 37)), list(range(50, 90))]

    def run(dev, mode, policy, fraction):
        e = _engine(path, dev, mode, "float32", policy=policy, fraction=fraction, max_num_seqs=4)
        gens = [e.start(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        while e.step():
            pass
        cap = e.runner.capture
        out = ([g.drain() for g in gens], cap.steps if cap is not None else 0)
        e.close()
        return out

    done = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(tmp)
        for policy in ("static", "lru", "hybrid"):
            for fraction in (0.25, 0.5, 1.0):
                want, _ = run("cpu", "graph", policy, fraction)
                for mode in ENGINE_MODES:
                    got, steps = run(device, mode, policy, fraction)
                    assert got == want, f"{mode} {policy} {fraction}: tokens differ from the CPU engine's"
                    assert mode != "captured" or steps > 0 or not device.startswith("cuda"), "no step was captured"
                done.append(f"{policy}@{fraction}")
    return f"{len(done) * len(ENGINE_MODES)} runs = the CPU engine ({', '.join(done)})"


@torch.no_grad()
def engine_speed(path: str, device: str, tokens: int, failures: list) -> None:
    """ms/token (GenerationStats, 64 tokens after a warm-up request) and kernel launches per decode token
    (torch.profiler: kernel launches and CUDA graph launches) of the engine's decode paths, all resident and at
    fraction 0.5 under lru."""
    from torch.profiler import ProfilerActivity, profile

    from moe_offload.engines.params import SamplingParams

    keys = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
    for policy, fraction in (("static", 1.0), ("lru", 0.5)):
        for mode in ENGINE_MODES:
            name = f"engine {mode} {policy}@{fraction}"
            try:
                e = _engine(path, device, mode, "bfloat16", policy=policy, fraction=fraction)
                prompt = list(range(3, 35))
                list(e.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True)))  # warm-up, captures
                g = e.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
                list(g)
                ms = g.stats.decode_ms_per_token
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                with profile(activities=acts) as prof:
                    list(e.generate(prompt, SamplingParams(max_tokens=9, ignore_eos=True)))
                ev = prof.key_averages()
                launches = sum(x.count for x in ev if x.key in keys) / 8  # 8 decode steps (+ one prefill, included)
                graphs = sum(x.count for x in ev if x.key == "cudaGraphLaunch") / 8
                line("PASS", name, f"{ms:.2f} ms/token, {launches:.0f} launches/token ({graphs:.0f} graph replays)")
                e.close()
            except Exception as ex:  # noqa: BLE001 - one line per check
                failures.append(name)
                line("FAIL", name, f"{type(ex).__name__}: {ex}")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


def speed_checks(device: str, layers: int, tokens: int, failures: list, model_dir: str | None = None,
                 profile: bool = False) -> None:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir or bench_checkpoint(tmp, layers)
        engine_speed(path, device, tokens, failures)  # the engine's paths: what a user runs
        stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        stock_ms = decode_ms(stock, device, tokens)
        line("PASS", "speed stock transformers", f"{stock_ms:.2f} ms/token ({layers} layers, bf16)")
        if profile:
            print_profile(stock, device)
        del stock
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--skip-family-tests", action="store_true")
    ap.add_argument("--model-dir", help="the speed checks' checkpoint (default: the benchmark model, built)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the all-resident decode")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    failures: list[str] = []
    checks = [("device", check_device), ("exactness tiny x policies", check_tiny_exactness),
              ("exactness engine paths", check_engine_exactness)]
    if not args.skip_family_tests:
        checks.append(("exactness families (pytest)", check_family_tests))
    if not args.device.startswith("cuda") or torch.cuda.device_count() >= 2:
        checks.append(("two devices (--devices)", check_two_devices))
    for name, fn in checks:
        try:
            line("PASS", name, fn(args.device))
        except Exception as e:  # noqa: BLE001
            failures.append(name)
            line("FAIL", name, f"{type(e).__name__}: {e}".splitlines()[0])
            traceback.print_exc(limit=3, file=sys.stderr)
            if name == "device":
                return 1
    speed_checks(args.device, args.layers, args.tokens, failures, args.model_dir, args.profile)
    print(f"{'FAILED' if failures else 'OK'}: {len(failures)} failed" + (f" ({', '.join(failures)})" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
