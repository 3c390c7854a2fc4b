"""`moe-offload demo-model | generate | profile`: the engine from the command line (torch loads inside)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moe_offload.commands.options import (
    COLD_DTYPE_CHOICE,
    COLD_DTYPE_HELP,
    DENSE_DTYPE_CHOICE,
    DEVICES_HELP,
    EXPERT_DTYPE_CHOICE,
    KV_DTYPE_CHOICE,
    KV_DTYPE_HELP,
    POLICY_CHOICE,
    SPECULATIVE_HELP,
    TAIL_SKIP_HELP,
    TENSOR_PARALLEL_HELP,
    emit,
    ranks_share_cores,
)
from moe_offload.engines.base import disk_rates
from moe_offload.errors import ConfigError, ModelError

POLICY_HELP = "Miss policy: static (misses computed on the host), lru (misses copied into slots), hybrid (by tokens per expert)."
DENSE_DTYPE_HELP = ("Dense linears (attention, shared experts, dense MLPs) and LM head: int8 holds them as int8 rows "
                    "with per-row scales (bf16 compute on cpu; decode reads half the bytes), bf16 keeps them "
                    "(default: as loaded).")
EXPERT_DTYPE_HELP = ("Experts in memory: int8 (per-channel) or fp8 (128x128 blocks) quantizes a bf16/fp32 checkpoint's "
                     "experts at load; bf16 dequantizes an MXFP4/FP8 checkpoint's (default: as the checkpoint stores them).")


def _quiet() -> None:
    """No transformers progress bars on the terminal: the commands print their own one-line summaries."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _model_dir(model: str | None) -> Path:
    """The checkpoint directory; the demo model when none is given (the trained one shipped with the package, else
    the random one, built on first use)."""
    if model:
        return Path(model).expanduser()
    from moe_offload import demo

    if demo.trained_dir() is None and not (demo.default_dir() / "config.json").is_file():
        click.echo(f"building the demo model (random weights) in {demo.default_dir()} ...", err=True)
    return demo.default_model()


def _require_tokenizer(path: Path) -> None:
    """Fail before loading weights when a text prompt cannot be tokenized."""
    if path.is_dir() and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelError(f"{path}: no tokenizer in the checkpoint directory; a text prompt needs one")


HOST_MEMORY_HELP = ("Host memory for routed experts, e.g. 8GiB; experts that do not fit live in an expert store file on "
                    "disk, host memory caching them (default: what the process's memory limit leaves).")


KV_HELP = ("KV cache budget, e.g. 2GiB (default: what the weights leave in the memory limit after a reserve, at most "
           "4GiB on the CPU; at least one --max-model-len sequence).")


def _engine_options(fn):
    fn = click.option("--max-model-len", type=click.IntRange(min=1),
                      help="Longest prompt + output (default: the model's, capped to the KV budget).")(fn)
    fn = click.option("--kv-cache-memory", help=KV_HELP)(fn)
    fn = click.option("--no-prefetch", is_flag=True, help="Disk tier: do not read the next layer's predicted experts ahead.")(fn)
    fn = click.option("--host-memory", help=HOST_MEMORY_HELP)(fn)
    fn = click.option("--dense-dtype", type=DENSE_DTYPE_CHOICE, help=DENSE_DTYPE_HELP)(fn)
    fn = click.option("--expert-dtype", type=EXPERT_DTYPE_CHOICE, help=EXPERT_DTYPE_HELP)(fn)
    fn = click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), help="Weights dtype (default: the checkpoint's).")(fn)
    fn = click.option("--placement", "placement", help="Placement JSON (from `moe-offload plan`); excludes --fraction.")(fn)
    fn = click.option("--fraction", type=float, help="Fraction 0..1 of each layer's experts resident on the accelerator (default 1.0).")(fn)
    fn = click.option("--policy", type=POLICY_CHOICE, default="static", show_default=True, help=POLICY_HELP)(fn)
    fn = click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True, help="Where the engine runs.")(fn)
    return fn


def _build(model: Path, backend: str, policy: str, fraction: float | None, placement: str | None, dtype: str | None,
           expert_dtype: str | None = None, dense_dtype: str | None = None, host_memory: str | None = None,
           no_prefetch: bool = False, kv_cache_memory: str | None = None, max_model_len: int | None = None,
           speculative: str | None = None, tail_skip: int | None = None, cold_dtype: str | None = None,
           devices: str | None = None, tensor_parallel: int | None = None, kv_cache_dtype: str = "auto"):
    from moe_offload.backends import get_backend

    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--fraction: expected a number in 0..1, got {fraction}")
    if fraction is not None and placement:
        raise ConfigError("give either --fraction or --placement, not both")
    options = {"policy": policy, "fraction": fraction, "dtype": dtype}
    if expert_dtype:
        options["expert_dtype"] = expert_dtype
    if dense_dtype:
        options["dense_dtype"] = dense_dtype
    if host_memory:
        from moe_offload.control.units import parse_size

        options["host_memory"] = parse_size(host_memory, "--host-memory")
    if no_prefetch:
        options["prefetch"] = False
    if kv_cache_memory:
        from moe_offload.control.units import parse_size

        options["kv_cache_memory"] = parse_size(kv_cache_memory, "--kv-cache-memory")
    if max_model_len:
        options["max_model_len"] = max_model_len
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    if speculative:
        from moe_offload.engines.params import SpeculativeConfig

        options["speculative"] = SpeculativeConfig.parse(speculative)  # checked before the model loads
    if tail_skip is not None:
        options["tail_skip"] = tail_skip
    if cold_dtype:
        options["cold_dtype"] = cold_dtype
    if devices:
        from moe_offload.control.devices import parse

        options["devices"] = parse(devices)  # checked before the model loads
    if tensor_parallel is not None:
        options["tensor_parallel"] = tensor_parallel
    return get_backend(backend).build_engine(str(model), placement, **options)


def _encode(engine, prompt: str, chat: bool) -> list[int]:
    tok = engine.tokenizer
    if tok is None:
        raise ModelError(f"{engine.info.model}: no tokenizer in the checkpoint directory; a text prompt needs one")
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    return [int(i) for i in tok(prompt)["input_ids"]]


@click.command("demo-model")
@click.option("--out", type=click.Path(file_okay=False), help="Directory to write (default: ~/.cache/moe-offload/demo-model).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Weights seed.")
def demo_model(out: str | None, seed: int) -> None:
    """Write the demo checkpoint: a small Qwen3-MoE with RANDOM weights and a locally trained tokenizer."""
    from moe_offload.demo import build_demo_model

    _quiet()
    click.echo(str(build_demo_model(out, seed=seed)))


@click.command("generate")
@click.option("--model", help="Checkpoint directory or GGUF file (default: the demo model, built on first use).")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Send the prompt as a user message through the tokenizer's chat template.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens to generate at most.")
@_engine_options
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, help="Sampling seed (same seed, same tokens).")
@click.option("--ignore-eos", is_flag=True, help="Keep going after an end-of-sequence token.")
@click.option("--speculative-config", help=SPECULATIVE_HELP)
@click.option("--tail-skip", type=int, metavar="RANK", help=TAIL_SKIP_HELP)
@click.option("--cold-dtype", type=COLD_DTYPE_CHOICE, help=COLD_DTYPE_HELP)
@click.option("--devices", help=DEVICES_HELP)
@click.option("--tensor-parallel", type=click.IntRange(min=1), metavar="N", help=TENSOR_PARALLEL_HELP)
@click.option("--kv-cache-dtype", type=KV_DTYPE_CHOICE, default="auto", show_default=True, help=KV_DTYPE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the token ids, text and stats as JSON.")
def generate(model, prompt, chat, max_tokens, backend, policy, fraction, placement, dtype, expert_dtype, dense_dtype,
             host_memory, no_prefetch, kv_cache_memory, max_model_len, temperature, top_p, top_k, seed, ignore_eos,
             speculative_config, tail_skip, cold_dtype, devices, tensor_parallel, kv_cache_dtype, as_json) -> None:
    """Generate text with the offload engine; stats go to stderr (or into --json)."""
    ranks_share_cores(tensor_parallel)  # before anything imports torch
    from moe_offload.engines.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            ignore_eos=ignore_eos)
    _quiet()
    path = _model_dir(model)
    _require_tokenizer(path)
    engine = _build(path, backend, policy, fraction, placement, dtype, expert_dtype, dense_dtype, host_memory, no_prefetch,
                    kv_cache_memory, max_model_len, speculative_config, tail_skip, cold_dtype, devices, tensor_parallel,
                    kv_cache_dtype)
    try:
        ids = _encode(engine, prompt, chat)
        gen = engine.generate(ids, params)
        tokens: list[int] = []
        shown = ""
        for token in gen:
            tokens.append(token)
            if as_json:
                continue
            # Stream: print what the text grew by; hold back a trailing partial UTF-8 character.
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
            if text.startswith(shown) and not text.endswith("\ufffd"):
                click.echo(text[len(shown):], nl=False)
                shown = text
        s = gen.stats
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        if as_json:
            out = {"model": engine.info.model, "backend": engine.info.backend, "policy": engine.info.policy,
                   "prompt_ids": ids, "token_ids": tokens, "text": text, "stats": s.to_dict(),
                   "token_ms": [round(t, 3) for t in s.token_ms],  # each decode step's wall ms, the first ones included
                   "experts": _experts(engine), "memory": getattr(engine, "memory_plan", None),
                   "approximate": engine.stats().get("approximate")}
            if getattr(engine, "ranks", None) is not None:  # --tensor-parallel: each rank's own experts' numbers
                out["ranks"] = _rounded(engine.stats()["ranks"])
            click.echo(json.dumps(out, indent=2))
            return
        click.echo(text[len(shown):] if text.startswith(shown) else "\n" + text)
        host = getattr(getattr(engine.offloaded, "placement", None), "host_tier", None)
        predicted = [f"{t} {r:.0%}" for t, r in engine.info.predicted_hit_rate.items() if t != host]
        spec = s.spec_summary() if s.spec_drafts else None
        click.echo(f"[{s.completion_tokens} tokens ({s.finish_reason}), prefill {s.prefill_ms:.0f} ms, "
                   f"decode {s.decode_ms_per_token:.1f} ms/token"
                   + (f" (speculative: {spec['mean_acceptance_length']:.2f} tokens per step, "
                      f"{spec['acceptance_rate']:.0%} of drafts accepted)" if spec else "")
                   + f", hit rate {s.hit_rate:.0%}"
                   + (" (" + ", ".join(f"{t} {s.hit_rate_by_tier.get(t, 0):.0%}" for t in s.tier_hits) + ")"
                      if s.tier_hits else "")
                   + (f" (predicted {', '.join(predicted)})" if predicted else "")
                   + f", host expert tokens {s.host_expert_tokens}, "
                   f"copied {sum(v for k, v in s.bytes_moved.items() if k != 'disk') / 1e6:.1f} MB" + _disk_line(s)
                   + (f"; APPROXIMATE ({engine.info.approximate})" if engine.info.approximate else "") + "]",
                   err=True)
    finally:
        engine.close()


def _rounded(v, key: str = ""):
    """``v`` with its floats as the request's stats print them: rates to 6 decimals, the rest (ms) to 3."""
    if isinstance(v, float):
        ratio = "rate" in key or key.rsplit(".", 1)[-1] in disk_rates({})  # the disk tier's ratios
        return round(v, 6 if ratio else 3)
    if isinstance(v, dict):
        return {k: _rounded(x, f"{key}.{k}") for k, x in v.items()}  # hit_rate_by_tier's values are rates
    if isinstance(v, list):
        return [_rounded(x, key) for x in v]
    return v


def _disk_line(s) -> str:
    """The disk tier's measured numbers for the summary line ("" without one)."""
    d = s.disk_summary()
    if not d:
        return ""
    return (f"; disk tier: host hits {d['host_hit_rate']:.0%}, read {d['disk_bytes_per_token'] / 1e6:.1f} MB/token, "
            f"stall {d['stall_ms_per_token']:.1f} ms/token")


def _experts(engine) -> dict:
    """How the engine holds the experts (format, bytes as stored); {} for engines without an offload executor."""
    if getattr(engine, "executor", None) is None or not hasattr(engine.executor, "layers"):
        return {}
    from moe_offload.engines.offload.loading.loader import expert_summary

    return expert_summary(engine.executor)


def read_prompts(path: str) -> list[tuple[str, str | None]]:
    """(prompt, class or None) per line of a JSONL file: {"prompt": "...", "class": "..."}."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--prompts: expected a JSONL file, got {path!r} (not found)")
    rows = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ConfigError(f'{path}:{n}: expected {{"prompt": "non-empty text", "class": optional}}, got {line[:80]!r}')
        cls = obj.get("class")
        if cls is not None and not isinstance(cls, str):
            raise ConfigError(f"{path}:{n}: class must be a string, got {cls!r}")
        rows.append((obj["prompt"], cls))
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows


def capture_routes(engine, prompts: list[list[int]], max_tokens: int = 1) -> tuple[list[int], list[list[list[list[int]]]]]:
    """Run each prompt (greedy, ``max_tokens``) with route capture on.

    Returns (MoE layer indices, per prompt: rows [T][L][K] of expert ids, one row per token the model read).
    """
    from moe_offload.engines.params import SamplingParams

    executor = engine.executor
    if executor is None or not hasattr(executor, "capture"):
        raise ConfigError(f"backend {engine.info.backend!r}: its engine cannot capture routes")
    layers = sorted(state.layer for state in executor.layers)
    out = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts:
        executor.capture(True)
        try:
            list(engine.generate(ids, params))
            records = executor.captured()
        finally:
            executor.capture(False)
        rows = []
        for rec in records:  # one forward: {layer: [T][K]}
            if not rec:
                continue
            T = len(rec[layers[0]])
            rows.extend([rec[layer][t] for layer in layers] for t in range(T))
        out.append(rows)
    return layers, out


@click.command("profile")
@click.option("--model", help="Checkpoint directory or GGUF file (default: the demo model).")
@click.option("--prompts", required=True, help='JSONL file, one {"prompt": "...", "class": "optional"} per line.')
@click.option("--out", required=True, help="Routes file to write (.safetensors or .json).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens generated per prompt; 1 records the prompt tokens only.")
@click.option("--chat", is_flag=True, help="Send each prompt through the chat template.")
@_engine_options
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
def profile_cmd(model, prompts, out, max_tokens, chat, backend, policy, fraction, placement, dtype, expert_dtype, dense_dtype,
                host_memory, no_prefetch, kv_cache_memory, max_model_len, as_json) -> None:
    """Record the top-k expert ids per MoE layer per token over a prompt set (a routes file for `plan`)."""
    from moe_offload.control.profile import Routes, save_routes
    from moe_offload.control.spec import ModelSpec

    if not (out.endswith(".safetensors") or out.endswith(".json")):
        raise ConfigError(f"--out: expected a .safetensors or .json path, got {out!r}")
    rows = read_prompts(prompts)
    _quiet()
    path = _model_dir(model)
    _require_tokenizer(path)
    engine = _build(path, backend, policy, fraction, placement, dtype, expert_dtype, dense_dtype, host_memory, no_prefetch,
                    kv_cache_memory, max_model_len)
    try:
        spec = ModelSpec.from_hf_config(str(path))
        layers, per_prompt = capture_routes(engine, [_encode(engine, p, chat) for p, _ in rows], max_tokens)
    finally:
        engine.close()
    classes: list[str] = []
    ids, class_ids = [], []
    labelled = any(c is not None for _, c in rows)
    for (_, cls), routes in zip(rows, per_prompt):
        ids.extend(routes)
        if labelled:
            name = cls if cls is not None else "unlabelled"
            if name not in classes:
                classes.append(name)
            class_ids.extend([classes.index(name)] * len(routes))
    result = Routes(model=spec.name, num_experts=spec.num_experts, layers=tuple(layers), ids=ids,
                    class_ids=class_ids if labelled else None, classes=tuple(classes))
    save_routes(out, result)
    summary = {"out": out, "model": spec.name, "prompts": len(rows), "tokens": result.num_tokens,
               "layers": len(layers), "top_k": result.top_k, "classes": list(classes)}
    emit(summary, as_json, f"wrote {out}: {result.num_tokens} tokens x {len(layers)} MoE layers x top-{result.top_k} "
                           f"from {len(rows)} prompts" + (f", classes {', '.join(classes)}" if classes else ""))


@click.command("convert")
@click.option("--model", help="Checkpoint directory or GGUF file (default: the demo model).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), help="Compute dtype, as for generate (default: the checkpoint's).")
@click.option("--expert-dtype", type=EXPERT_DTYPE_CHOICE, help=EXPERT_DTYPE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the store's path and sizes as JSON.")
def convert_cmd(model, dtype, expert_dtype, as_json) -> None:
    """Prepare the expert store the disk tier reads, in $MOE_OFFLOAD_STORE_DIR or ~/.cache/moe-offload/stores: where
    the checkpoint holds experts as the engine keeps them (bf16 safetensors, GGUF blocks), a manifest of where each
    expert lies in its files (read in place, no copy); else a copy of every routed expert as the engine stores it
    (quantized once for --expert-dtype), one aligned record per expert. The engine does this itself when experts do
    not fit in host memory; this does it ahead of the first run."""
    import time

    from moe_offload.engines.offload.loading.convert import convert_checkpoint

    _quiet()
    t0 = time.perf_counter()
    man, written = convert_checkpoint(str(_model_dir(model)), dtype, expert_dtype)
    layers = list(man.layers.values())
    summary = {"store": str(man.dir), "format": man.fmt, "written": written, "seconds": round(time.perf_counter() - t0, 2),
               "bytes": man.data_bytes, "disk_bytes": man.disk_bytes, "in_place": man.in_place, "layers": len(layers),
               "experts_per_layer": layers[0].num_experts if layers else 0,
               "record_bytes": layers[0].record_bytes if layers else 0}
    held = (f"read in place from the checkpoint's files (the store is its {man.disk_bytes / 2**10:.0f} KiB manifest)"
            if man.in_place else f"{man.data_bytes / 2**30:.2f} GiB copied")
    emit(summary, as_json, f"{'wrote' if written else 'found'} {man.dir}: {man.fmt} experts {held}, "
                           f"{len(layers)} layers, {summary['record_bytes']} bytes per expert record")


commands = [demo_model, generate, profile_cmd, convert_cmd]
