"""Where one decode step's time goes (issue 12, part 1): a per-stage profile of the engine's decode loop.

    python bench/profile_decode.py --model-dir /tmp/benchmodel     # the benchmark model (bench_engine.py), 64 steps
    python bench/profile_decode.py --quick                         # a tiny model, 8 steps: proves it works
    python bench/profile_decode.py --model-dir /tmp/benchmodel --torch-profiler 16   # + torch.profiler's top ops

    engine.generate (build_offload_engine, as `moe-offload generate`) --decode steps--> module hooks (perf_counter)
      --> exclusive time per stage and step --> median over steps --> table (ms/step, share of the step)

Stages, exclusive (a parent's time minus its hooked children's, so the rows add up to the step):
embedding, rotary embedding, attention (projections, q/k norms, rope, KV cache, SDPA), norms, router, experts
(the offload executor; split by its own counters into device / host / fetch), shared experts, dense MLP, MoE block
glue, decoder-layer glue (residual adds), model glue (masks, positions), LM head (with the logits slice), sampling,
and the engine loop (the rest of the step: stats, the generator, Python between forwards). Hooks cost time
themselves: the step is also measured without them, and the difference is printed.

The stages are the module path's: the fused decode path (engines/offload/model/fastpath.py) calls no modules, so the
stage run switches it off; its step time is measured in the same run and printed beside, and --torch-profiler
profiles what the engine runs (the fused path where the family is covered).

Works for any family the engine loads: modules are found by role (embeddings, decoder layers, their attention,
norm and MLP children, the MLP's router, experts and shared experts). A stage the model lacks reads 0.
Run on an idle machine; print the command with the table (docs/benchmarks/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

QUICK_SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                   vocab_size=2048, max_position_embeddings=512)
STAGES = ("embedding", "rotary embedding", "attention", "norms", "router", "experts", "shared experts", "dense MLP",
          "MoE block glue", "decoder-layer glue", "model glue", "LM head", "sampling", "engine loop")
_ATTN = ("self_attn", "attention", "attn", "self_attention", "linear_attn", "mixer")
_MLP = ("mlp", "block_sparse_moe", "feed_forward", "moe", "ffn")
_ROUTER = ("gate", "router")
_SHARED = ("shared_expert", "shared_experts", "shared_mlp", "shared_expert_gate")


def stage_map(model) -> dict[torch.nn.Module, str]:
    """Each module worth timing -> its stage. Parents get a glue stage (their time less their children's)."""
    from moe_offload.engines.offload.loading.architecture import is_experts_module

    out: dict[torch.nn.Module, str] = {model: "LM head"}  # the CausalLM wrapper's own time: the logits slice
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        out[base] = "model glue"
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None:
        out[emb] = "embedding"
    if head is not None:
        out[head] = "LM head"
    layers = next((m for n, m in (base or model).named_children() if n in ("layers", "h", "blocks")), None)
    for name, child in (base or model).named_children():
        if "rotary" in name:
            out[child] = "rotary embedding"
        elif "norm" in name:
            out[child] = "norms"
    for layer in layers or ():
        out[layer] = "decoder-layer glue"
        for name, child in layer.named_children():
            if name in _ATTN:
                out[child] = "attention"
            elif "norm" in name:
                out[child] = "norms"
            elif name in _MLP:
                experts = [m for m in child.modules() if is_experts_module(m)]
                out[child] = "MoE block glue" if experts else "dense MLP"
                for sub_name, sub in child.named_children():
                    if is_experts_module(sub) or sub_name == "experts":
                        out[sub] = "experts"
                    elif sub_name in _ROUTER:
                        out[sub] = "router"
                    elif sub_name in _SHARED:
                        out[sub] = "shared experts"
    return out


class StageTimer:
    """Module hooks that book each module's exclusive time to its stage, per decode step."""

    def __init__(self, model, stages: dict):
        self.model = model
        self.stages = stages
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.recording = False
        self._stack: list[list] = []  # [stage, t0, children's inclusive time]
        self._handles = []

    def install(self) -> None:
        for m, stage in self.stages.items():
            self._handles.append(m.register_forward_pre_hook(self._pre(m is self.model)))
            self._handles.append(m.register_forward_hook(self._post(stage)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, top: bool):
        def hook(_m, _args):
            now = time.perf_counter()
            if top and self.recording:  # a new decode step starts at the model's forward
                self.close(now)
                self.current = {"_t0": now}
            self._stack.append([None, now, 0.0])
        return hook

    def _post(self, stage: str):
        def hook(_m, _args, _out):
            now = time.perf_counter()
            frame = self._stack.pop()
            dt = now - frame[1]
            if self.current is not None:
                self.current[stage] = self.current.get(stage, 0.0) + dt - frame[2]
                self.current["_forward"] = self.current.get("_forward", 0.0) + (dt if not self._stack else 0.0)
            if self._stack:
                self._stack[-1][2] += dt
        return hook

    def add(self, stage: str, seconds: float) -> None:
        if self.current is not None:
            self.current[stage] = self.current.get(stage, 0.0) + seconds

    def close(self, now: float) -> None:
        """End the open step at ``now``: what no hook saw is the engine loop."""
        if self.current is None:
            return
        step = now - self.current.pop("_t0")
        forward = self.current.pop("_forward", 0.0)
        self.current["engine loop"] = step - forward - self.current.get("sampling", 0.0)
        self.current["_step"] = step
        self.steps.append(self.current)
        self.current = None


def _patch_sampling(timer: StageTimer):
    """Time the engine's per-step sampling (``sample`` in the runtime's output module: every sequence of a step at
    once); None when the engine samples elsewhere (sampling is then in the loop)."""
    import moe_offload.engines.offload.runtime.output as output_module

    original = getattr(output_module, "sample", None)
    if original is None:
        return None

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.add("sampling", time.perf_counter() - t0)

    output_module.sample = timed
    return lambda: setattr(output_module, "sample", original)


def _executor_stage_ms(engine) -> dict[str, float]:
    stats = getattr(getattr(engine, "executor", None), "stats", None)
    return dict(stats.snapshot().get("stage_ms", {})) if stats is not None else {}


def decode(engine, prompt: list[int], tokens: int, timer: StageTimer | None = None):
    """One request of ``tokens`` decode steps after the prompt; with ``timer``, steps after the first token are
    recorded. Returns (engine step times in ms, the executor's stage ms over the decode steps)."""
    from moe_offload.engines.params import SamplingParams

    gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    it = iter(gen)
    next(it)  # prefill + first token
    before = _executor_stage_ms(engine)
    if timer is not None:
        timer.recording = True
    for _ in it:
        pass
    if timer is not None:
        timer.close(time.perf_counter())
        timer.recording = False
    after = _executor_stage_ms(engine)
    return list(gen.stats.token_ms), {k: v - before.get(k, 0.0) for k, v in after.items()}


def profile(engine, prompt: list[int], tokens: int) -> dict:
    """Per-stage medians (ms per decode step) with and without hooks, on the module path (hooks see modules; the
    fused decode path and the owned graph call none), and the fused path's step where the engine has one."""
    runner = getattr(engine, "runner", None)  # the offload engine's model runner holds the fused plan and the graph
    plan, graph = getattr(runner, "fast", None), getattr(runner, "graph", None)
    fused_ms = statistics.median(decode(engine, prompt, tokens)[0]) if plan is not None else None
    if runner is not None:  # the modules' steps: the hooks time each module
        runner.fast = runner.graph = None
    try:
        plain_ms, _ = decode(engine, prompt, tokens)
        timer = StageTimer(engine.model, stage_map(engine.model))
        unpatch = _patch_sampling(timer)
        timer.install()
        try:
            hooked_ms, stage_ms = decode(engine, prompt, tokens, timer)
        finally:
            timer.remove()
            if unpatch:
                unpatch()
    finally:
        if runner is not None:
            runner.fast, runner.graph = plan, graph
    steps = timer.steps
    med = {s: statistics.median(st.get(s, 0.0) for st in steps) * 1000 for s in STAGES}
    mean = {s: statistics.fmean(st.get(s, 0.0) for st in steps) * 1000 for s in STAGES}
    # "other" is the executor's forward time outside its stages: the hooks above split it finer
    split = {k: v / len(steps) for k, v in stage_ms.items() if k != "other"} if steps else {}
    return {"steps": len(steps), "plain_ms": statistics.median(plain_ms), "hooked_ms": statistics.median(hooked_ms),
            "step_ms": statistics.median(st["_step"] for st in steps) * 1000, "median": med, "mean": mean,
            "executor_split": split, "sampling_timed": unpatch is not None, "fused_ms": fused_ms,
            "modules": len(timer.stages), "per_step": steps}


def torch_profile(engine, prompt: list[int], tokens: int, rows: int = 25) -> str:
    """torch.profiler over ``tokens`` decode steps: the top ops by self CPU time, as a markdown table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from moe_offload.engines.params import SamplingParams

    gen = engine.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    it = iter(gen)
    next(it)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in it:
            pass
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    path = "fused decode path" if getattr(getattr(engine, "runner", None), "fast", None) is not None else "module path"
    lines = [f"torch.profiler, {tokens} decode steps ({path}): top {rows} ops by self CPU time (per step)\n",
             "| op | calls/step | self ms/step | share |", "|---|---:|---:|---:|"]
    for e in events[:rows]:
        lines.append(f"| `{e.key}` | {e.count / tokens:.1f} | {e.self_cpu_time_total / 1000 / tokens:.3f} | "
                     f"{e.self_cpu_time_total / total:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 8 decode steps, 8-token prompt")
    ap.add_argument("--model-dir", type=Path, help="the benchmark model here (built if absent); default a temp dir")
    ap.add_argument("--tokens", type=int, help="decode steps profiled (default 64; quick 8)")
    ap.add_argument("--context", type=int, help="prompt tokens before decoding (default 128; quick 8)")
    ap.add_argument("--fraction", type=float, default=1.0, help="resident fraction (default 1.0: all experts)")
    ap.add_argument("--policy", default="static", help="miss policy (default static)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as the llama.cpp comparison)")
    ap.add_argument("--torch-profiler", type=int, default=0, metavar="STEPS", help="also run torch.profiler over STEPS steps")
    args = ap.parse_args(argv)
    tokens = args.tokens or (8 if args.quick else 64)
    context = args.context or (8 if args.quick else 128)
    from transformers.utils import logging

    logging.disable_progress_bar()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import SHAPE, build_model, prompt_ids

    from moe_offload.engines.offload.runtime.build import build_offload_engine
    from moe_offload.engines.offload.tools.calibrate import cpu_name

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="profile-decode-") as tmp:
        path = build_model(args.model_dir or Path(tmp), shape=QUICK_SHAPE if args.quick else SHAPE)
        engine = build_offload_engine(path, policy=args.policy, fraction=args.fraction, dtype="bfloat16")
        try:
            vocab = engine.info.vocab_size
            prompt = prompt_ids(context, vocab)
            decode(engine, prompt, 4)  # warm-up: kernels built, caches allocated
            r = profile(engine, prompt, tokens)
            table = torch_profile(engine, prompt, args.torch_profiler) if args.torch_profiler else ""
        finally:
            engine.close()

    cmd = "python bench/profile_decode.py" + (" " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else "")
    kernels = os.environ.get("MOE_OFFLOAD_KERNELS", "default")
    print(f"Command: `{cmd}`  ")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads, "
          f"MOE_OFFLOAD_KERNELS={kernels}  ")
    print(f"{r['steps']} decode steps after a {context}-token prompt, policy {args.policy}, fraction {args.fraction:g}; "
          f"{r['modules']} modules hooked.  ")
    print(f"Step without hooks {r['plain_ms']:.3f} ms (engine's median), with hooks {r['hooked_ms']:.3f} ms: the hooks "
          f"cost {r['hooked_ms'] - r['plain_ms']:.3f} ms/step, spread over the stages. The stages are the module "
          "path's (hooks see modules)" + (f"; the fused decode path (what the engine runs for this model) took "
                                          f"{r['fused_ms']:.3f} ms/step in the same run.\n" if r["fused_ms"] else ".\n"))
    print("| stage | ms/step (median) | mean | share of the step |")
    print("|---|---:|---:|---:|")
    step = sum(r["median"].values()) or 1.0
    for s in STAGES:
        if s == "sampling" and not r["sampling_timed"]:
            print("| sampling | not timed (the engine samples outside `sample`; it is in the loop) | | |")
            continue
        print(f"| {s} | {r['median'][s]:.3f} | {r['mean'][s]:.3f} | {r['median'][s] / step:.1%} |")
    print(f"| **step** (median of steps) | **{r['step_ms']:.3f}** | {sum(r['mean'].values()):.3f} | |")
    split = {k: v for k, v in r["executor_split"].items() if v}
    if split:
        print("\nInside the experts (and router) stage, the executor's own counters, ms/step: "
              + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    if table:
        print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
