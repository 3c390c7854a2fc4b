"""Engine benchmark (issue 4): decode ms/token and prefill tok/s of the offload engine against stock transformers.

    python bench/bench_engine.py            # full run: 64 decode tokens, 128-token prompt, 3 repeats
    python bench/bench_engine.py --quick    # proves it works: 8 tokens, 16-token prompt, 1 repeat
    python bench/bench_engine.py --expert-dtype int8   # the engine's experts quantized at load (int8 | fp8 | bf16)

Model: Qwen3-MoE-shaped, random bf16 weights (16 layers x 64 experts, hidden 1024, expert
intermediate 512, top-8, 16 heads, 4 KV heads, vocab 32000: 1.7B parameters, 3.4 GB), built into a
temp dir (or --model-dir, reused if it holds a config.json). For fractions 0/0.1/0.25/0.5/1.0 x
policies static/lru/hybrid, stock `generate()` on the same model, and the memory-bandwidth bound:
bytes one decode token must read / read bandwidth measured here (a large fp32 tensor sum), and an
interleaved A/B of stock against the all-resident engine (fair on a busy machine). Prints markdown tables. Run on an idle machine; two cores are easily disturbed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe_offload.control.vocab import EXPERT_DTYPES, MISS_POLICIES

SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    vocab_size=32000,
    max_position_embeddings=4096,
)
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)


def build_model(out: Path, seed: int = 0, shape: dict | None = None) -> Path:
    """A random-weight bf16 Qwen3-MoE checkpoint of ``shape`` (default: the benchmark model) in ``out``, once."""
    from transformers import Qwen3MoeConfig

    from moe_offload.demo import save_random_model

    if (out / "config.json").is_file():
        return out
    config = Qwen3MoeConfig(**(shape or SHAPE), norm_topk_prob=True, tie_word_embeddings=False, dtype="bfloat16")
    t0 = time.perf_counter()
    if config.num_hidden_layers > 16:  # larger than memory may hold at once: written layer by layer
        _save_streamed(out, config, seed)
    else:
        save_random_model(out, config, seed=seed, dtype=torch.bfloat16)
    gc.collect()
    print(f"built the benchmark model in {time.perf_counter() - t0:.1f} s at {out}", file=sys.stderr)
    return out


def _save_streamed(out: Path, config, seed: int, shard_bytes: int = 2 * 2**30) -> None:
    """A random bf16 checkpoint of ``config`` written one layer at a time into shards of ~``shard_bytes`` (a model
    bigger than this machine's memory, e.g. the 72-layer disk-tier benchmark): the tensor names and shapes of a
    one-layer model saved by transformers, repeated per layer; weights N(0, initializer_range), norms 1."""
    import copy
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moe_offload.demo import save_random_model

    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(tmp, one, seed=seed, dtype=torch.bfloat16)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as h:
            shapes = {k: h.get_slice(k).get_shape() for k in h.keys()}
    g = torch.Generator().manual_seed(seed)
    std = config.initializer_range

    def tensor(shape):
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)

    glob = [k for k in shapes if not k.startswith("model.layers.0.")]
    groups = [[(k, shapes[k]) for k in glob]] + [
        [(k.replace("model.layers.0.", f"model.layers.{i}.", 1), shapes[k]) for k in shapes if k.startswith("model.layers.0.")]
        for i in range(config.num_hidden_layers)]
    out.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, n, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, size, n = {}, 0, n + 1

    for group in groups:
        for k, shape in group:
            t = tensor(shape)
            shard[k] = t
            size += t.numel() * 2
            total += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    config.architectures = ["Qwen3MoeForCausalLM"]  # as the model's own save writes it (converters read it)
    config.save_pretrained(out)


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Best-of read bandwidth in bytes/s of a sum over a ``gib`` GiB fp32 tensor (the calibration's measurement)."""
    from moe_offload.engines.offload.tools.calibrate import read_bandwidth as measure

    return measure(torch.device("cpu"), int(gib * 2**30), repeats)


def decode_bytes(model, expert_bytes: int | None = None) -> int:
    """Bytes one decode token must read: every non-expert weight except the embedding table
    (one row is read), plus top-k experts per MoE layer (``expert_bytes``: one expert of every layer as the
    engine stores it, e.g. int8 with its scales; default: as loaded)."""
    cfg = model.config
    total = 0
    loaded = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += p.shape[1] * p.element_size()
        elif ".experts." in name:
            loaded += p[0].numel() * p.element_size()  # one expert of this tensor, summed over layers
        else:
            total += p.numel() * p.element_size()
    return total + (loaded if expert_bytes is None else expert_bytes) * cfg.num_experts_per_tok


def stored_expert_bytes(path: Path, expert_dtype: str | None) -> int | None:
    """One expert of every MoE layer as the engine holds it with ``--expert-dtype`` (None: as loaded)."""
    if expert_dtype is None:
        return None
    from moe_offload.control.spec import ModelSpec

    spec = ModelSpec.from_hf_config(path).with_expert_dtype(expert_dtype)
    return spec.expert_bytes * spec.num_moe_layers


def prompt_ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


class _Clock:
    """A generate() streamer that timestamps every token (the first put() is the prompt)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


def bench_stock(path: Path, prompt: list[int], tokens: int, repeats: int) -> dict:
    """transformers' own generate() (greedy, its default experts implementation) on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    steps, prefill = [], []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kw)  # warm-up
        for _ in range(repeats):
            clock = _Clock()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, streamer=clock, **kw)
            prefill.append(clock.t[1] - t0)
            steps += [(b - a) * 1000 for a, b in zip(clock.t[1:], clock.t[2:])]
    nbytes = decode_bytes(model)
    impl = model.config._experts_implementation
    del model
    gc.collect()
    return {"prefill_tok_s": len(prompt) / min(prefill), "decode_ms": statistics.median(steps),
            "decode_mean_ms": statistics.fmean(steps), "impl": impl, "decode_bytes": nbytes}


def bench_engine(path: Path, prompt: list[int], tokens: int, repeats: int, policy: str, fraction: float,
                 expert_dtype: str | None = None) -> dict:
    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    engine = build_offload_engine(path, policy=policy, fraction=fraction, dtype="bfloat16", expert_dtype=expert_dtype)
    try:
        list(engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True)))  # warm-up
        runs = []
        for _ in range(repeats):
            gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
            list(gen)
            runs.append(gen.stats)
        steps = [t for s in runs for t in s.token_ms]
        last = runs[-1]
        return {
            "prefill_tok_s": len(prompt) / (min(s.prefill_ms for s in runs) / 1000),
            "decode_ms": statistics.median(steps),
            "decode_mean_ms": statistics.fmean(steps),
            "hit_rate": last.hit_rate,
            "host_tokens": last.host_expert_tokens,
            "bytes_moved": sum(last.bytes_moved.values()),
        }
    finally:
        engine.close()
        del engine
        gc.collect()


def ab_compare(path: Path, prompt: list[int], rounds: int, block: int = 8, expert_dtype: str | None = None) -> dict:
    """Stock generate() and the all-resident engine, alternating in blocks of ``block`` decode tokens in one
    process, so both see the same background load: the fair ratio on a busy machine."""
    from transformers import AutoModelForCausalLM

    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.params import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engine = build_offload_engine(path, policy="static", fraction=1.0, dtype="bfloat16", expert_dtype=expert_dtype)
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def stock(n):
        clock = _Clock()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=clock, **kw)
        return [(b - a) * 1000 for a, b in zip(clock.t[1:], clock.t[2:])]

    def ours(n):
        gen = engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        list(gen)
        return gen.stats.token_ms

    try:
        stock(3), ours(3)  # warm-up
        s, o = [], []
        for _ in range(rounds):
            s += stock(block + 1)
            o += ours(block + 1)
    finally:
        engine.close()
        del model, engine
        gc.collect()
    q = lambda d, f: sorted(d)[int(f * (len(d) - 1))]  # noqa: E731
    return {"n": len(s), "stock": {k: q(s, f) for k, f in (("min", 0), ("p25", .25), ("median", .5))},
            "ours": {k: q(o, f) for k, f in (("min", 0), ("p25", .25), ("median", .5))}}


def main(argv: list[str] | None = None) -> int:
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 decode tokens, 16-token prompt, 1 repeat")
    ap.add_argument("--tokens", type=int, help="decode tokens per run (default 64; quick 8)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 128; quick 16)")
    ap.add_argument("--repeats", type=int, help="runs per configuration (default 3; quick 1)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--policies", default=",".join(MISS_POLICIES))
    ap.add_argument("--model-dir", type=Path, help="build (or reuse) the model here instead of a temp dir")
    ap.add_argument("--no-stock", action="store_true", help="skip stock transformers (and the A/B)")
    ap.add_argument("--ab-rounds", type=int, help="interleaved stock/ours rounds of 8 tokens (default 8; quick 2; 0 = skip)")
    ap.add_argument("--expert-dtype", choices=tuple(EXPERT_DTYPES),
                    help="the engine's experts: quantized at load (int8 | fp8) or bf16; stock stays bf16")
    args = ap.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokens = args.tokens or (8 if args.quick else 64)
    plen = args.prompt_len or (16 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    ab_rounds = args.ab_rounds if args.ab_rounds is not None else (2 if args.quick else 8)
    fractions = [float(f) for f in args.fractions.split(",") if f]
    policies = [p for p in args.policies.split(",") if p]

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        path = build_model(args.model_dir or Path(tmp))
        prompt = prompt_ids(plen, SHAPE["vocab_size"])
        bw = read_bandwidth()
        stock = None if args.no_stock else bench_stock(path, prompt, tokens, repeats)
        if stock is None or args.expert_dtype:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            nbytes = decode_bytes(m, stored_expert_bytes(path, args.expert_dtype))  # what the engine reads
            del m
        else:
            nbytes = stock["decode_bytes"]
        bound_ms = nbytes / bw * 1000
        ab = ab_compare(path, prompt, ab_rounds, expert_dtype=args.expert_dtype) if ab_rounds and not args.no_stock else None
        rows = []
        for policy in policies:
            for fraction in fractions:
                try:
                    r = bench_engine(path, prompt, tokens, repeats, policy, fraction, args.expert_dtype)
                except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                    print(f"  {policy:6} {fraction:4}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                rows.append((policy, fraction, r))
                print(f"  {policy:6} {fraction:4}: {r['decode_ms']:.1f} ms/token", file=sys.stderr)

    cmd = "python bench/bench_engine.py" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    print(f"Command: `{cmd}`  ")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads  ")
    print(f"Prompt {plen} tokens, {tokens} decode tokens x {repeats} runs per configuration; decode = median ms/token "
          f"(mean in brackets), prefill = best run.  ")
    if args.expert_dtype:
        print(f"Engine experts: {args.expert_dtype} (quantized at load; stock transformers runs the bf16 checkpoint).  ")
    print(f"Bandwidth bound: {nbytes / 1e6:.0f} MB read per decode token / {bw / 1e9:.1f} GB/s measured "
          f"= **{bound_ms:.1f} ms/token**\n")
    print("| configuration | decode ms/token | prefill tok/s | of bound | vs stock | hit rate | host expert tokens | bytes copied |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    if stock:
        print(f"| stock transformers generate() ({stock['impl']}) | {stock['decode_ms']:.1f} ({stock['decode_mean_ms']:.1f}) | {stock['prefill_tok_s']:.0f} | "
              f"{bound_ms / stock['decode_ms']:.0%} | 1.00 | | | |")
    for policy, fraction, r in rows:
        vs = f"{stock['decode_ms'] / r['decode_ms']:.2f}" if stock else ""
        print(f"| {policy}, fraction {fraction:g} | {r['decode_ms']:.1f} ({r['decode_mean_ms']:.1f}) | {r['prefill_tok_s']:.0f} | "
              f"{bound_ms / r['decode_ms']:.0%} | {vs} | {r['hit_rate']:.2f} | {r['host_tokens']} | {r['bytes_moved'] / 1e6:.0f} MB |")
    print("\n\"of bound\" = bandwidth-bound ms/token / measured ms/token; \"vs stock\" = stock ms/token / ours (>= 1.0 is as fast or faster).")
    if ab:
        print(f"\nInterleaved A/B, all resident (static, fraction 1) against stock generate(), {ab['n']} decode steps each, "
              "alternating blocks of 8 tokens:\n")
        print("| ms/token | stock | ours | stock / ours |")
        print("|---|---:|---:|---:|")
        for k in ("min", "p25", "median"):
            a, b = ab["stock"][k], ab["ours"][k]
            print(f"| {k} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
