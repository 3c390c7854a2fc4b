"""Measure a Calibration for the cost model on one device, in a few seconds.

    read bandwidth      sum over a large fp32 tensor (best of N)
    dense GEMV          one token through [R, H] weights (R >= 4096) in the model's dtype, cycling over > LLC of them
    expert kernel       dispatch.expert_forward at 1 and 128 tokens for the model's expert shape, cycling
                        over many experts (a decode step reads experts that are not in cache)
    bus                 cpu: copy one expert into a preallocated slot buffer (what a CPU fetch does);
                        cuda: pinned host -> device non_blocking copies of one expert, timed with events
    overheads           tiny Qwen3-MoEs (hidden 64, 1 and 4 layers) through the real engine, all experts
                        resident: ms/token minus their expert calls; the slope over layers is the per-layer
                        overhead (dispatch, router, norms, executor), the rest per step (LM head, sampling)

On a CPU "accelerator" the host and the device are the same cores: the host numbers are the device
numbers (one measurement, labelled so). Legend: H hidden, I expert intermediate, R output rows, N tokens.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch

from moe_offload.control.calibration import Calibration, Quantity
from moe_offload.control.vocab import QUANTIZED_FORMATS
from moe_offload.engines.offload.kernels.dispatch import expert_forward

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_SHAPE = dict(hidden=1024, intermediate=512, dtype="bfloat16")  # the engine benchmark's expert
FLOPS_TOKENS = 128


class _Timer:
    """Wall time on the CPU; CUDA events on a GPU (the host thread only launches), recorded on ``stream`` when given
    (fetches run on a side stream)."""

    def __init__(self, dev: torch.device, stream=None):
        self.cuda, self.stream = dev.type == "cuda", stream

    def __call__(self, fn, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` calls of ``fn``."""
        out = []
        for _ in range(repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(self.stream)
                fn()
                b.record(self.stream)
                b.synchronize()
                out.append(a.elapsed_time(b) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        name = None
    return name or platform.processor() or platform.machine()


def _machine(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{platform.node()} {torch.cuda.get_device_name(dev)}"
    return f"{platform.node()} {cpu_name()} ({os.cpu_count()} cpus, {torch.get_num_threads()} torch threads)"


def read_bandwidth(dev: torch.device, nbytes: int, repeats: int = 9) -> float:
    """Best-of read bandwidth, bytes/s: a sum streams the tensor from memory once."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    x.sum()  # touch every page
    best = min(_Timer(dev)(lambda: x.sum(), repeats))
    return x.numel() * 4 / best


def _cycling(timer, calls: list, rounds: int) -> float:
    """Best seconds per call over ``rounds`` passes through ``calls`` (each pass one timing; best-of resists
    interference from other processes, as bandwidth benchmarks do)."""
    def one_pass():
        for c in calls:
            c()

    one_pass()  # warm-up (allocator, kernels)
    return min(timer(one_pass, rounds)) / len(calls)


def gemv_bandwidth(dev: torch.device, hidden: int, rows: int, dtype: torch.dtype, buffer_bytes: int) -> float:
    """bytes/s of one token through [rows, hidden] weights, cycling over enough copies to leave the cache."""
    per = rows * hidden * torch.finfo(dtype).bits // 8
    n = max(4, buffer_bytes // per)
    w = torch.full((n, rows, hidden), 0.01, dtype=dtype, device=dev)  # [n, R, H]
    x = torch.full((1, hidden), 0.5, dtype=dtype, device=dev)  # [1, H]
    linear = torch.nn.functional.linear
    if dev.type == "cpu" and dtype == torch.bfloat16:
        from moe_offload.engines.offload.kernels import jit, ops

        if jit.load():  # the engine's one-token linears run through the GEMV kernel: measure that
            linear = ops.gemv_bf16
    t = _cycling(_Timer(dev), [lambda i=i: linear(x, w[i]) for i in range(n)], 9)
    return per / t


def _experts_module(hidden: int, intermediate: int, count: int, dtype: torch.dtype, dev: torch.device):
    """A transformers gated-SiLU experts module ([E, 2I, H] / [E, H, I]) with ``count`` experts, constant weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    with torch.device("meta"):
        m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=count))
    up = torch.full((count, 2 * intermediate, hidden), 0.01, dtype=dtype, device=dev)  # [E, 2I, H]
    down = torch.full((count, hidden, intermediate), 0.01, dtype=dtype, device=dev)  # [E, H, I]
    return m, up, down


def _expert_store(hidden: int, intermediate: int, count: int, dtype: torch.dtype, fmt: str | None, device):
    """``count`` experts in store order (store.WEIGHT_NAMES) on ``device``: float ``dtype``, or ``fmt`` ("int8" |
    "fp8", quantized from the same constant weights; each expert its own copy, so calls stream memory)."""
    from moe_offload.engines.offload.experts.store import LayerStore, convert

    up = torch.full((count, 2 * intermediate, hidden), 0.01, dtype=dtype)  # [E, 2I, H]
    down = torch.full((count, hidden, intermediate), 0.01, dtype=dtype)  # [E, H, I]
    store = LayerStore((up, down), dtype)
    if fmt is not None:
        one = convert(LayerStore((up[:1], down[:1]), dtype), fmt, transposed=False, split=intermediate)
        store = LayerStore(tuple(t.repeat(count, *([1] * (t.dim() - 1))) if t is not None else None for t in one.tensors), dtype)
    return LayerStore(tuple(t.to(device) if t is not None else None for t in store.tensors), dtype)


def expert_rates(dev: torch.device, hidden: int, intermediate: int, dtype: torch.dtype, buffer_bytes: int,
                 fmt: str | None = None) -> tuple[float, float]:
    """(bytes/s at 1 token, flop/s at FLOPS_TOKENS tokens) of dispatch.expert_forward on ``dev`` (experts stored in
    ``fmt``: None = ``dtype``; bytes/s counts stored bytes)."""
    per = _expert_store(hidden, intermediate, 1, dtype, fmt, "cpu").expert_bytes
    count = max(8, buffer_bytes // per)
    module, _, _ = _experts_module(hidden, intermediate, 1, dtype, torch.device("meta"))
    store = _expert_store(hidden, intermediate, count, dtype, fmt, dev)
    timer = _Timer(dev)
    x1 = torch.full((1, hidden), 0.5, dtype=dtype, device=dev)  # [1, H]
    t1 = _cycling(timer, [lambda e=e: expert_forward(module, x1, *store.expert(e)) for e in range(count)], 9)
    xn = torch.full((FLOPS_TOKENS, hidden), 0.5, dtype=dtype, device=dev)  # [N, H]
    few = list(range(min(count, 16)))
    tn = _cycling(timer, [lambda e=e: expert_forward(module, xn, *store.expert(e)) for e in few], 3)
    return per / t1, 2 * 3 * hidden * intermediate * FLOPS_TOKENS / tn


def bus_bandwidth(dev: torch.device, hidden: int, intermediate: int, dtype: torch.dtype, buffer_bytes: int,
                  fmt: str | None = None) -> float:
    """bytes/s of copying one expert (as stored, ``fmt``) from the host store into a slot on ``dev``, as the executor does."""
    per = _expert_store(hidden, intermediate, 1, dtype, fmt, "cpu").expert_bytes
    count = max(8, buffer_bytes // per)
    src = tuple(t for t in _expert_store(hidden, intermediate, count, dtype, fmt, "cpu").tensors if t is not None)
    if dev.type == "cuda":
        src = tuple(t.pin_memory() for t in src)
    dst = tuple(torch.empty((2, *t.shape[1:]), dtype=t.dtype, device=dev) for t in src)  # two slots, alternating

    def copy(e):  # what the executor's fetch does: each of the expert's tensors into the slot's views
        for d, s in zip(dst, src):
            d[e % 2].copy_(s[e], non_blocking=True)

    calls = [lambda e=e: copy(e) for e in range(count)]
    if dev.type == "cuda":
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            t = _cycling(_Timer(dev, stream), calls, 3)
    else:
        t = _cycling(_Timer(dev), calls, 3)
    return per / t


def _tiny_step_ms(dev: torch.device, layers: int, top_k: int, tokens: int, runs: int,
                  dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(median decode ms/token, ms of one tiny expert call) of a tiny all-resident Qwen3-MoE through the real engine,
    in ``dtype`` (bf16 on the CPU takes the fused decode path, as a bf16 model's decode steps do)."""
    from transformers import Qwen3MoeConfig

    from moe_offload.demo import save_random_model
    from moe_offload.engines.offload.loading.loader import load_model
    from moe_offload.engines.offload.runtime.engine import OffloadEngine
    from moe_offload.engines.params import SamplingParams

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=max(8, top_k),
                         num_experts_per_tok=top_k, vocab_size=256, max_position_embeddings=512,
                         tie_word_embeddings=False, dtype=str(dtype).removeprefix("torch."))
    with tempfile.TemporaryDirectory(prefix="moe-calibrate-") as tmp:
        save_random_model(tmp, cfg)
        engine = OffloadEngine(load_model(tmp, None, policy="static", device=str(dev)), None, backend=dev.type)
        try:
            steps = []
            for seed in range(runs):
                gen = engine.generate(list(range(1, 9)), SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                        temperature=1.0, seed=seed))
                list(gen)
                steps += gen.stats.token_ms[2:] or gen.stats.token_ms
            # the lower quartile, not the median: like the best-of elsewhere, it resists another process
            # taking a core for a while (on a quiet machine the two differ by a few per cent)
            best = statistics.quantiles(steps, n=4)[0] if len(steps) > 1 else steps[0]
            module = engine.model.model.layers[0].mlp.experts
            w = engine.executor.layers[0].cache.weights[0]
            x = torch.full((1, 64), 0.5, dtype=dtype, device=dev)
            call = _cycling(_Timer(dev), [lambda: expert_forward(module, x, *w)] * 64, 5)
        finally:
            engine.close()
    return best, call * 1000


def overheads_ms(dev: torch.device, top_k: int, tokens: int = 24, runs: int = 2,
                 dtype: torch.dtype = torch.float32) -> tuple[float, float, str]:
    """(per-layer ms, per-step ms, how): tiny all-resident models of 1 and 4 layers in ``dtype`` through the real
    engine, their expert calls subtracted; the slope over layers is per layer, the rest per step."""
    (one, call), (four, _) = (_tiny_step_ms(dev, 1, top_k, tokens, runs, dtype),
                              _tiny_step_ms(dev, 4, top_k, tokens, runs, dtype))
    one_x, four_x = one - top_k * call, four - 4 * top_k * call  # without their expert calls
    per_layer = max(0.0, (four_x - one_x) / 3)
    per_step = max(0.0, one_x - per_layer)
    how = (f"tiny qwen3_moe (hidden 64, top-{top_k}, {str(dtype).removeprefix('torch.')}) all resident, 1 and 4 "
           f"layers: {one:.3f} / {four:.3f} ms/token "
           f"minus expert calls of {call * 1000:.1f} us")
    return per_layer, per_step, how


def disk_bandwidth(nbytes: int, chunk: int = 4 << 20, threads: int = 8) -> tuple[float, str]:
    """(bytes/s, how) of reads from the disk tier's filesystem as the host cache does them: a file of ``nbytes``
    written in the store directory, dropped from the page cache, read back in ``chunk`` records with O_DIRECT (where
    the filesystem allows), ``threads`` in flight; the file is removed after."""
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from moe_offload.engines.offload.experts import diskstore
    from moe_offload.hostmem import store_root

    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="calibrate-", suffix=".bin", dir=root)
    try:
        block = os.urandom(chunk)
        for _ in range(nbytes // chunk):
            os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = -1
        try:
            rfd, direct = os.open(name, os.O_RDONLY | os.O_DIRECT), True
        except OSError:
            rfd, direct = os.open(name, os.O_RDONLY), False
        bufs = [memoryview(diskstore.aligned_empty(chunk).numpy()) for _ in range(threads)]
        offsets = list(range(0, nbytes // chunk * chunk, chunk))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            n = sum(ex.map(lambda i: os.preadv(rfd, [bufs[i % threads]], offsets[i]), range(len(offsets))))
        dt = time.perf_counter() - t0
        os.close(rfd)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)
    return n / dt, (f"{n >> 20} MiB in {chunk >> 20} MiB reads, {threads} in flight, "
                    f"{'O_DIRECT' if direct else 'buffered'}, from {root}")


def calibrate(device: str = "cpu", spec=None, *, quick: bool = False, overhead: bool = True) -> Calibration:
    """Measure a Calibration on ``device`` ("cpu" | "cuda[:N]") for ``spec``'s expert shape (a ModelSpec,
    or None: hidden 1024, intermediate 512, bf16). ``quick`` uses small buffers (tests);
    ``overhead=False`` skips the tiny-model run (the per-layer overhead is then assumed)."""
    from moe_offload.engines.offload.loading.loader import resolve_device

    dev = resolve_device(device)
    H = spec.hidden_size if spec is not None else DEFAULT_SHAPE["hidden"]
    I = spec.expert_intermediate_size if spec is not None else DEFAULT_SHAPE["intermediate"]
    dtype_name = spec.dtype if spec is not None else DEFAULT_SHAPE["dtype"]
    dtype = DTYPES.get(dtype_name, torch.bfloat16)
    if dev.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16  # the CPU engine computes half checkpoints as loaded; bf16 is the closer kernel
    # Large enough that one call streams memory: per-call dispatch belongs to the layer overhead term
    rows = max(4096, spec.num_attention_heads * spec.head_dim if spec is not None else H)
    cache_bytes = 48 << 20 if quick else (384 << 20 if dev.type == "cpu" else 2 << 30)
    read_bytes = 128 << 20 if quick else (512 << 20 if dev.type == "cpu" else 4 << 30)
    k = spec.top_k if spec is not None else 8
    # quantized experts (a quantized checkpoint, or --expert-dtype) are measured in their format; the compute dtype
    # of a quantized checkpoint is its dtype
    fmt = spec.expert_format if spec is not None and spec.expert_format in QUANTIZED_FORMATS else None
    ebytes = _expert_store(H, I, 1, dtype, fmt, "cpu").expert_bytes
    where = f"{dev}, {str(dtype).removeprefix('torch.')}" + (f", experts {fmt}" if fmt else "")
    t0 = time.perf_counter()
    with torch.inference_mode():
        read = read_bandwidth(dev, read_bytes)
        gemv = gemv_bandwidth(dev, H, rows, dtype, cache_bytes)
        dev_bw, dev_flops = expert_rates(dev, H, I, dtype, cache_bytes, fmt)
        if dev.type == "cpu":
            host_bw, host_flops, host_how = dev_bw, dev_flops, "same cores as the cpu accelerator: its measurement"
        else:
            host_bw, host_flops = expert_rates(torch.device("cpu"), H, I, dtype, min(cache_bytes, 384 << 20), fmt)
            host_how = "dispatch.expert_forward on the host CPU"
        bus = bus_bandwidth(dev, H, I, dtype, cache_bytes, fmt)
    if overhead:
        # in the model's compute dtype: a bf16 model decodes through the fused path on the CPU, an fp32 one does not
        per_layer, per_step, ovh_how = overheads_ms(dev, min(k, 8), *((10, 1) if quick else (24, 3)), dtype=dtype)
        ovh_q = Quantity(per_layer, "measured", ovh_how + ": slope per layer")
        step_q = Quantity(per_step, "measured", ovh_how + ": the rest, per step")
    else:
        ovh_q, step_q = Calibration.assumed(dev.type).layer_overhead_ms, Calibration.assumed(dev.type).step_overhead_ms
    try:
        disk, disk_how = disk_bandwidth((32 if quick else 512) << 20)
        disk_q = Quantity(disk, "measured", disk_how)
    except OSError as e:  # a read-only or full store directory: the assumed rate, saying why
        disk_q = Quantity(Calibration.assumed(dev.type).value("disk_read_bytes_per_s"), "assumed",
                          f"not measured: {e}")
    m = "measured"
    return Calibration(
        device=str(dev),
        device_read_bytes_per_s=Quantity(read, m, f"sum of {read_bytes >> 20} MiB fp32 on {dev}, best of 9"),
        device_gemv_bytes_per_s=Quantity(gemv, m, f"1 token x [{rows}, {H}] linear, {where}, cycling {cache_bytes >> 20} MiB"),
        device_expert_bytes_per_s=Quantity(dev_bw, m, f"expert_forward 1 token, H {H} I {I}, {where}, cycling {cache_bytes >> 20} MiB"),
        device_expert_flops_per_s=Quantity(dev_flops, m, f"expert_forward {FLOPS_TOKENS} tokens, H {H} I {I}, {where}"),
        host_expert_bytes_per_s=Quantity(host_bw, m, host_how + " (1 token)"),
        host_expert_flops_per_s=Quantity(host_flops, m, host_how + f" ({FLOPS_TOKENS} tokens)"),
        bus_bytes_per_s=Quantity(bus, m, ("pinned -> device non_blocking copy of one expert on a side stream, CUDA events"
                                          if dev.type == "cuda" else "copy of one expert into a preallocated slot buffer")),
        layer_overhead_ms=ovh_q,
        step_overhead_ms=step_q,
        disk_read_bytes_per_s=disk_q,
        machine=_machine(dev),
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        expert_shape={"hidden": H, "intermediate": I, "dtype": str(dtype).removeprefix("torch."), "expert_bytes": ebytes,
                      "expert_params": 3 * H * I, **({"format": fmt} if fmt else {})},
        notes=(f"measured in {time.perf_counter() - t0:.1f} s" + (" (quick: small buffers)" if quick else ""),),
    )
