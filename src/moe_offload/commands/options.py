"""Options and output shared by the CLI's commands: help texts, choices from the shared vocabulary, emit.

    cli.py --loads--> commands/*.py --import--> options.py --> control.vocab (choices), click
Commands import from here, never from cli.py or from each other (no import circle).
"""

from __future__ import annotations

import json
import os
import sys

import click

from moe_offload.control.vocab import DENSE_DTYPES, EXPERT_DTYPES, KV_CACHE_DTYPES, MISS_POLICIES
from moe_offload.errors import ConfigError

MODEL_HELP = "Checkpoint directory, config.json, or a GGUF file (or a directory holding one)."
PROFILE_HELP = "a built-in name (`moe-offload hardware` lists them) or a JSON file"
EXPERT_DTYPE_CHOICE = click.Choice(list(EXPERT_DTYPES))
DENSE_DTYPE_CHOICE = click.Choice(list(DENSE_DTYPES))
POLICY_CHOICE = click.Choice(list(MISS_POLICIES))
KV_DTYPE_CHOICE = click.Choice(list(KV_CACHE_DTYPES))
KV_DTYPE_HELP = ("KV cache storage: auto (the model dtype), or APPROXIMATE int8 / fp8 (e4m3) rows with a scale per "
                 "token and head, about half the bytes of bf16: twice the tokens in the same budget.")
PRICE_EXPERT_DTYPE_HELP = ("Price the experts as the engine's --expert-dtype holds them: int8 | fp8 (quantized at load) "
                           "or bf16 (default: as the checkpoint stores them, e.g. MXFP4 or FP8).")


def emit(data, as_json: bool, text: str) -> None:
    """Print JSON or the human text."""
    click.echo(json.dumps(data, indent=2) if as_json else text)


def expert_dtype_option(fn):
    """--expert-dtype for the planning commands: price the experts in that format."""
    return click.option("--expert-dtype", type=EXPERT_DTYPE_CHOICE, default=None, help=PRICE_EXPERT_DTYPE_HELP)(fn)


def load_calibration_option(path: str | None, device: str = "cuda", hardware: str | None = None):
    """--calibration FILE, or --hardware NAME|FILE, or the assumed defaults for ``device`` when neither is given."""
    from moe_offload.control.calibration import Calibration

    if path and hardware:
        raise ConfigError("give one of --calibration FILE or --hardware NAME|FILE, not both")
    if hardware:
        from moe_offload.control.hardware import load_hardware

        return load_hardware(hardware).calibration()
    return Calibration.load(path) if path else Calibration.assumed(device)


def prediction_rows(preds) -> list[str]:
    lines = []
    for p in preds:
        b = p.breakdown()
        lines.append(f"  {p.policy:6} on {p.placement_policy:8} {p.ms_per_token:9.3f} ms/token ({p.tokens_per_s:7.1f} tok/s)"
                     f"  device experts {b['device_experts_ms']:.3f}, host experts {b['host_experts_ms']:.3f}, "
                     f"fetch {b['fetch_ms']:.3f}, dense {b['dense_ms']:.3f}, overhead {b['overhead_ms']:.3f}"
                     + (f", disk {b['disk_ms']:.3f}" if b["disk_ms"] else "")
                     + (f", overlap {b['overlap_ms']:.3f}" if b["overlap_ms"] else "")
                     + f"; hit rate {p.accelerator_hit_rate:.1%}"
                     + (f", host tier {p.host_tier_hit_rate:.1%} ({p.disk_bytes_per_token / 1e6:.1f} MB read/token)"
                        if p.host_tier_hit_rate is not None else ""))
    return lines


TAIL_SKIP_HELP = ("APPROXIMATE (off by default): skip a token's routed experts ranked RANK or lower (0-based by router "
                  "weight: 3 = the 4th and later) when they are not resident; output is labelled approximate.")
COLD_DTYPE_HELP = ("APPROXIMATE (off by default): experts that miss are computed on the host from an int8 or int4 "
                   "copy (resident ones stay as stored; the copy costs host memory); output is labelled approximate.")
COLD_DTYPE_CHOICE = click.Choice(["int8", "int4"])
DEVICES_HELP = ("Several accelerators, each a tier of its own: cuda:0,cuda:1 (cpu,cpu exercises it on the CPU). The "
                "fraction's expert slots are split over them, the hottest experts balanced by predicted load; the "
                "first runs the dense layers. Stats report hits per device.")
TENSOR_PARALLEL_HELP = ("N ranks on torch.distributed (gloo on the CPU), each computing its share of every layer's experts "
                        "(expert e on rank e mod N); OpenMP threads that sleep when idle (OMP_WAIT_POLICY=PASSIVE, "
                        "unless set) let every rank use every core; this process is rank 0. Output is the "
                        "one-process output; --json reports each rank's stats.")


def ranks_share_cores(tensor_parallel: int | None) -> None:
    """--tensor-parallel N > 1: OpenMP threads that sleep when idle (OMP_WAIT_POLICY=PASSIVE, unless the user set a
    policy), so a rank that waits for the others' rows leaves its cores to them and every rank can use every core
    (ranks/parallel.py); spinning ranks sharing cores run several times slower (docs/benchmarks/parallel.md).
    OpenMP reads the policy when torch loads it: only before torch is imported does this take effect."""
    from moe_offload import settings

    if tensor_parallel is not None and tensor_parallel > 1 and "torch" not in sys.modules and not settings.is_set(
            "OMP_WAIT_POLICY"):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
SPECULATIVE_HELP = ("Speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                    "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} (prompt lookup) or {\"model\": DIR, "
                    "\"num_speculative_tokens\": 3} (a draft model sharing the tokenizer) or {\"method\": \"mtp\"} (the "
                    "checkpoint's own MTP layer: DeepSeek-V3, GLM-4.5). Exact: greedy output is "
                    "unchanged, sampling keeps its distribution.")
