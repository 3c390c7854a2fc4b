"""llama.cpp's own converter against this engine's GGUF loader, per family: the same model from safetensors through
transformers and from the converter's GGUF through `--model FILE.gguf`, fp32 logits compared (issue 19).

    python bench/check_gguf_families.py --families-dir /tmp/families       # the family suite's checkpoints

    checkpoint (bench_families.py builds them) --convert_hf_to_gguf.py--> GGUF bf16 (bench_llamacpp.to_gguf, cached)
    transformers fp32 on the checkpoint | this engine fp32 on the GGUF (every expert resident) --> max |logit diff|

A bf16 GGUF holds the checkpoint's bf16 weights exactly, so any difference beyond fp32 summation order is a layout the
loader got wrong (the converter permutes llama's q/k rows, splits DeepSeek's kv_b, de-interleaves gpt-oss's gate/up,
appends GLM's next-token layer). Not part of CI: it needs llama.cpp's converter and the checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_families import FAMILIES  # noqa: E402  (the suite's families, whose checkpoints this reads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families-dir", type=Path, required=True, help="one checkpoint directory per family")
    ap.add_argument("--families", default=",".join(FAMILIES))
    a = ap.parse_args(argv)

    import torch
    from bench_llamacpp import to_gguf
    from transformers import AutoModelForCausalLM

    from moe_offload.engines.offload.loading.loader import load_model

    torch.set_num_threads(2)
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 77, 3]])
    print("| family | GGUF (llama.cpp converter, bf16) | max abs logit diff, fp32 | logit std | argmax equal |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for fam in a.families.split(","):
        ckpt = a.families_dir / fam
        gguf = to_gguf(ckpt, "bf16")
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(ids).logits.float()
        del ref
        om = load_model(str(gguf), None, dtype="float32")
        with torch.no_grad():
            got = om.model(ids).logits.float()
        del om
        diff = (got - want).abs().max().item()
        worst = max(worst, diff / want.std().item())
        same = bool((got.argmax(-1) == want.argmax(-1)).all())
        print(f"| {fam} | {gguf.name} | {diff:.2e} | {want.std().item():.3f} | {same} |", flush=True)
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
