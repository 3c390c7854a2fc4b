"""Train the demo MoE: a small Qwen3-MoE that has learned Python from CPython's own standard library.

    python bench/train_demo.py --out src/moe_offload/data/trained-demo          # the shipped model (~25 min, 2 cores)
    python bench/train_demo.py --out /tmp/td --steps 40 --eval-every 20        # proves it works (~1 min)

Corpus: every ``*.py`` of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``, its
test suites and site-packages excluded), sorted by path; every 20th file is held out (the test split), the rest is
training text. Tokenizer: the project's own byte-level BPE trainer (``moe_offload.demo.train_tokenizer``) on the
training split. Model: Qwen3-MoE (SHAPE: 4 layers, 16 routed experts, top-4, hidden 192, tied embeddings), trained
from seed ``--seed`` with AdamW on random 256-token windows of the training split (one generator, fixed order:
the same seed, interpreter, torch and --threads give the same weights), fp32 on the CPU, router load-balancing
loss at transformers' default coefficient (included in the recorded training loss; the held-out loss is the
next-token loss alone).

Writes the checkpoint (bf16 safetensors, the tokenizer, README.md) and ``training.json``: the loss curve, the
held-out perplexity at each evaluation, the corpus (files, bytes, sha256 of the file list) and, per MoE layer, the
share of routed tokens each expert took on the held-out split (how skewed the trained routers are).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=192, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=48, num_experts=16, num_experts_per_tok=4,
             max_position_embeddings=1024)
VOCAB = 2048
WINDOW = 256
HELD_OUT_EVERY = 20


def corpus() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library's Python sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def listing_sha256(train: list[Path], held: list[Path]) -> str:
    """sha256 of the corpus's file list (relative paths, training then held-out): which stdlib the model saw."""
    root = sysconfig.get_paths()["stdlib"]
    return hashlib.sha256("\n".join(str(f.relative_to(root)) for f in train + held).encode()).hexdigest()


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def encode(tok, texts: list[str]) -> torch.Tensor:
    """One stream of token ids: each file's tokens then <|endoftext|>."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for t in texts:
        ids += tok(t)["input_ids"] + [eot]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, windows: int = 64) -> float:
    """Mean next-token loss (nats) over ``windows`` evenly spaced windows of the held-out stream."""
    model.eval()
    starts = torch.linspace(0, len(data) - WINDOW - 2, windows).long()
    total = 0.0
    for s in starts.split(16):
        x = torch.stack([data[i : i + WINDOW + 1] for i in s.tolist()])
        total += model(x[:, :-1], labels=x[:, :-1]).loss.item() * len(s)  # transformers shifts the labels
    model.train()
    return total / windows


@torch.no_grad()
def expert_load(model, data: torch.Tensor, windows: int = 64) -> list[list[float]]:
    """Per MoE layer, the share of routed (token, k) pairs each expert took on the held-out stream."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts)
    starts = torch.linspace(0, len(data) - WINDOW - 1, windows).long()
    model.eval()
    for s in starts.split(16):
        x = torch.stack([data[i : i + WINDOW] for i in s.tolist()])
        out = model(x, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            top = logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(top, minlength=cfg.num_experts).float()
    model.train()
    return (counts / counts.sum(-1, keepdim=True)).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16, help="windows of 256 tokens per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_offload.demo import train_tokenizer

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    train_files, held_files = corpus()
    train_text, held_text = read(train_files), read(held_files)
    tok = train_tokenizer(train_text, VOCAB, max_length=SHAPE["max_position_embeddings"])
    train, held = encode(tok, train_text), encode(tok, held_text)
    print(f"corpus: {len(train_files)} + {len(held_files)} files, {len(train)} + {len(held)} tokens, "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3MoeConfig(vocab_size=len(tok), **SHAPE, norm_topk_prob=True, tie_word_embeddings=True,
                            bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id, dtype="float32",
                            output_router_logits=False, router_aux_loss_coef=0.001)
    torch.manual_seed(a.seed)
    model = Qwen3MoeForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))
    g = torch.Generator().manual_seed(a.seed)
    curve, evals = [], []
    t1 = time.perf_counter()
    for step in range(1, a.steps + 1):
        idx = torch.randint(0, len(train) - WINDOW - 1, (a.batch,), generator=g)
        x = torch.stack([train[i : i + WINDOW] for i in idx.tolist()])
        out = model(x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        curve.append(round(out.loss.item(), 4))
        if step % a.eval_every == 0 or step == a.steps:
            h = held_out_loss(model, held)
            evals.append({"step": step, "held_out_loss": round(h, 4), "held_out_ppl": round(math.exp(h), 2),
                          "train_loss_mean_last": round(sum(curve[-a.eval_every:]) / len(curve[-a.eval_every:]), 4),
                          "seconds": round(time.perf_counter() - t1, 1)})
            print(json.dumps(evals[-1]), file=sys.stderr, flush=True)
    load = expert_load(model, held)
    a.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(a.out)
    tok.save_pretrained(a.out)
    cfg = json.loads((a.out / "config.json").read_text())
    cfg["moe_offload_note"] = ("TRAINED: a moe-offload demo model trained on CPython's standard library sources "
                               "(bench/train_demo.py); small, so its code is plausible, not correct")
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    report = {
        "command": "python bench/train_demo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": sys.version.split()[0], "torch": torch.__version__, "seed": a.seed, "steps": a.steps,
        "batch_windows": a.batch, "window": WINDOW, "lr": a.lr, "shape": SHAPE, "vocab": len(tok),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {"train_files": len(train_files), "held_out_files": len(held_files), "train_tokens": len(train),
                   "held_out_tokens": len(held), "train_bytes": sum(len(t.encode()) for t in train_text),
                   "file_list_sha256": listing_sha256(train_files, held_files)},
        "evals": evals, "loss_curve": curve, "expert_load_held_out": [[round(v, 4) for v in row] for row in load],
        "train_seconds": round(time.perf_counter() - t1, 1),
    }
    (a.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    (a.out / "README.md").write_text(
        f"# moe-offload trained demo model\n\nA Qwen3-MoE ({SHAPE['num_hidden_layers']} layers, "
        f"{SHAPE['num_experts']} routed experts, top-{SHAPE['num_experts_per_tok']}, hidden {SHAPE['hidden_size']}, "
        f"{report['parameters'] / 1e6:.1f}M parameters) trained by `bench/train_demo.py` for {a.steps} steps on the "
        f"Python sources of CPython {report['python']}'s standard library ({len(train)} training tokens; every "
        f"{HELD_OUT_EVERY}th file held out). Held-out perplexity {evals[-1]['held_out_ppl']} (per token of its "
        f"{len(tok)}-token byte-level BPE). It writes plausible Python, not correct Python. See training.json.\n")
    print(f"wrote {a.out}: held-out ppl {evals[-1]['held_out_ppl']}, {report['train_seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
