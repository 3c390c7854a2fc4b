"""Train an MTP layer for the trained demo model, so MTP drafts can be measured on a model that has learned something.

    python bench/train_mtp.py --out /tmp/demo-mtp               # ~6 min on 2 cores
    python bench/train_mtp.py --out /tmp/demo-mtp --steps 20    # proves it works

The target (src/moe_offload/data/trained-demo, a Qwen3-MoE) stays frozen. The MTP layer is DeepSeek-V3's design
(one more decoder layer of the target's kind; row p takes the token after it, t_{p+1}, and the target's final-normed
hidden state h_p: eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)]) -> the layer -> a norm -> the target's tied head),
trained to predict t_{p+2} on the same training split of the standard library (bench/train_demo.py's corpus and
tokenizer), initialised from the target's last layer. Writes a copy of the demo checkpoint with the layer's tensors
under ``model.layers.4.`` (per-expert linears, as releases store them) and ``num_nextn_predict_layers: 1``, and
``mtp_training.json`` (the loss curve; held-out top-1 accuracy of t_{p+2}, teacher-forced).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DEMO = HERE.parent / "src" / "moe_offload" / "data" / "trained-demo"


def _norm(w: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class MTP(torch.nn.Module):
    def __init__(self, target):
        super().__init__()
        cfg, inner = target.config, target.model
        H, n = cfg.hidden_size, cfg.num_hidden_layers
        self.layer = type(inner.layers[-1])(cfg, n)
        self.layer.load_state_dict(inner.layers[-1].state_dict())
        self.enorm, self.hnorm, self.head_norm = (torch.nn.Parameter(torch.ones(H)) for _ in range(3))
        self.eh_proj = torch.nn.Parameter(torch.cat([0.02 * torch.randn(H, H), torch.eye(H)], dim=1))
        self.eps, self.target = cfg.rms_norm_eps, [target]

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x [B, W + 1] tokens, h [B, W, H] the target's final-normed rows -> logits [B, W - 1, V] for t_{p+2}."""
        target = self.target[0]
        e = target.model.embed_tokens(x[:, 1:-1]).clone()  # t_{p+1} for p = 0..W-2
        e[:, 0] = 0.0  # position 0's embedding masked, as the engine (and vLLM) runs it
        inp = torch.cat([_norm(self.enorm, e, self.eps), _norm(self.hnorm, h[:, :-1], self.eps)], -1) @ self.eh_proj.T
        pos = torch.arange(inp.shape[1]).unsqueeze(0).expand(inp.shape[0], -1)
        out = self.layer(inp, attention_mask=None, position_ids=pos,
                         position_embeddings=target.model.rotary_emb(inp, pos))
        out = out[0] if isinstance(out, tuple) else out
        return target.lm_head(_norm(self.head_norm, out, self.eps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from safetensors.torch import load_file, save_file
    from train_demo import WINDOW, corpus, encode, read
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(DEMO)
    train_files, held_files = corpus()
    train, held = encode(tok, read(train_files)), encode(tok, read(held_files))
    target = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32, attn_implementation="sdpa").eval()
    for p in target.parameters():
        p.requires_grad_(False)
    mtp = MTP(target)
    opt = torch.optim.AdamW([p for p in mtp.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed)

    def batch(data, starts):
        x = torch.stack([data[i : i + WINDOW + 1] for i in starts])
        with torch.no_grad():
            h = target.model(input_ids=x[:, :-1]).last_hidden_state  # [B, W, H]
        return x, h

    curve, t0 = [], time.perf_counter()
    for step in range(1, a.steps + 1):
        x, h = batch(train, torch.randint(0, len(train) - WINDOW - 2, (a.batch,), generator=g).tolist())
        logits = mtp(x, h)
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(round(loss.item(), 4))
        if step % 100 == 0:
            print(f"step {step}: loss {sum(curve[-100:]) / 100:.3f}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    mtp.eval()
    right = total = 0
    with torch.no_grad():
        for s in torch.linspace(0, len(held) - WINDOW - 2, 64).long().split(16):
            x, h = batch(held, s.tolist())
            pred = mtp(x, h).argmax(-1)
            right += int((pred == x[:, 2:]).sum())
            total += pred.numel()

    a.out.mkdir(parents=True, exist_ok=True)
    for f in DEMO.iterdir():
        if f.is_file():
            shutil.copy(f, a.out / f.name)
    sd = load_file(str(DEMO / "model.safetensors"))
    n = target.config.num_hidden_layers
    pre = f"model.layers.{n}."
    layer = {k: v for k, v in mtp.layer.state_dict().items()}
    gate_up, down = layer.pop("mlp.experts.gate_up_proj"), layer.pop("mlp.experts.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        layer[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        layer[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        layer[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    layer |= {"enorm.weight": mtp.enorm, "hnorm.weight": mtp.hnorm, "eh_proj.weight": mtp.eh_proj,
              "shared_head.norm.weight": mtp.head_norm}
    sd |= {pre + k: v.detach().to(torch.bfloat16).contiguous() for k, v in layer.items()}
    save_file(sd, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((a.out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    report = {"command": "python bench/train_mtp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "steps": a.steps, "batch_windows": a.batch, "window": WINDOW, "lr": a.lr, "seed": a.seed,
              "held_out_top1_t_plus_2": round(right / total, 4), "train_seconds": round(time.perf_counter() - t0, 1),
              "loss_curve": curve}
    (a.out / "mtp_training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}: held-out top-1 of t+2 {right / total:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
