"""The demo models: the trained one shipped with the package, and a random-weight one built for tests.

    data/trained-demo/             a Qwen3-MoE trained on CPython's standard library (bench/train_demo.py): what
                                   `generate`, `serve` and `make demo` run when given no --model
    data/demo_corpus.txt --tokenizers BPE--> tokenizer.json (+ chat template)
    Qwen3MoeConfig + seed --torch init--> model.safetensors, config.json, README.md   (`moe-offload demo-model`)

The random one exists so that tests build a real checkpoint in seconds with nothing downloaded: it speaks nonsense,
deterministically. Same seed -> byte-identical files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from moe_offload import settings
from moe_offload.errors import ConfigError

DEFAULT_DIR = None  # $MOE_OFFLOAD_CACHE_DIR/demo-model (tests set a folder of their own)
NOTE = "RANDOM WEIGHTS: a moe-offload demo/test model; its output is deterministic nonsense"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, with tools in the Hermes / Qwen style: tool signatures in the system turn, the assistant's calls as
# <tool_call>{"name", "arguments"}</tool_call>, tool results as <tool_response> user turns. Without tools it
# renders exactly as plain ChatML.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions. Their signatures, within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return a JSON object with the function name and arguments within <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and tools and loop.first %}
{%- elif message['role'] == 'assistant' %}<|im_start|>assistant
{{ message['content'] or '' }}
{%- for call in message['tool_calls'] or [] %}
<tool_call>
{"name": {{ call['function']['name'] | tojson }}, "arguments": {{ call['function']['arguments'] | tojson if call['function']['arguments'] is mapping else call['function']['arguments'] }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Small enough to build in seconds and decode in a few ms/token on a laptop CPU.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=2048,
)
VOCAB = 1024
README = """# moe-offload demo model ({note})

A Qwen3-MoE-architecture checkpoint built by `moe-offload demo-model` (seed {seed}):
{layers} layers, {experts} routed experts per layer, top-{top_k}, hidden size {hidden}.
The weights were drawn at random; nothing was trained. The tokenizer is a byte-level
BPE trained locally on the text shipped in `moe_offload/data/demo_corpus.txt`.
Use it to try the CLI and the engine, and in tests; never to judge output quality.
"""


def trained_dir() -> Path | None:
    """The trained demo model shipped with the package (bench/train_demo.py wrote it), None where it is absent."""
    d = Path(str(resources.files("moe_offload").joinpath("data/trained-demo")))
    return d if (d / "model.safetensors").is_file() and (d / "config.json").is_file() else None


def default_model() -> Path:
    """The model commands run when given none: the trained demo model, else the random one (built on first use)."""
    return trained_dir() or ensure_demo_model()


def default_dir() -> Path:
    return Path(DEFAULT_DIR).expanduser() if DEFAULT_DIR is not None else settings.cache_dir("demo-model")


def _corpus() -> list[str]:
    text = resources.files("moe_offload").joinpath("data/demo_corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def build_tokenizer(vocab_size: int = VOCAB):
    """A transformers PreTrainedTokenizerFast trained on the shipped corpus (byte-level BPE, ChatML template)."""
    return train_tokenizer(_corpus(), vocab_size)


def train_tokenizer(texts, vocab_size: int, max_length: int = SHAPE["max_position_embeddings"]):
    """The project's tokenizer trainer: a byte-level BPE of ``vocab_size`` over ``texts`` (an iterable of str) with
    the ChatML specials and template, as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def save_random_model(out: str | os.PathLike, config, *, seed: int = 0, dtype=None) -> Path:
    """Random weights for a transformers ``config`` saved in ``out`` (test and benchmark models).

    The caller's random stream is left as it was; ``dtype`` (a torch dtype) initialises in that precision.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    model.save_pretrained(out)
    return Path(out)


def build_demo_model(out_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write the demo checkpoint to ``out_dir`` (default ~/.cache/moe-offload/demo-model); returns the directory.

    Deterministic: the same seed gives byte-identical files. Existing files in ``out_dir`` are replaced.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"demo model seed: expected an integer >= 0, got {seed!r}")
    out = Path(out_dir).expanduser() if out_dir is not None else default_dir()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: expected a directory, got the file {out}")
    try:  # before the build: an unwritable place fails at once
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create its parent directory ({e.strerror or e})") from None
    tokenizer = build_tokenizer()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        **SHAPE,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        moe_offload_note=NOTE,
    )
    # fork_rng: building the demo must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    try:
        _write(out, model, tokenizer, seed)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write the demo model ({e.strerror or e})") from None
    return out


def _write(out: Path, model, tokenizer, seed: int) -> None:
    # Build next to the target, then move files in: an interrupted build never leaves a half model.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".demo-build-") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        Path(tmp, "README.md").write_text(
            README.format(
                note=NOTE, seed=seed, layers=SHAPE["num_hidden_layers"], experts=SHAPE["num_experts"],
                top_k=SHAPE["num_experts_per_tok"], hidden=SHAPE["hidden_size"],
            ),
            encoding="utf-8",
        )
        out.mkdir(exist_ok=True)
        for f in sorted(Path(tmp).iterdir()):
            target = out / f.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(f, target)


def ensure_demo_model(out_dir: str | os.PathLike | None = None) -> Path:
    """The demo model directory, built on first use."""
    out = Path(out_dir).expanduser() if out_dir is not None else default_dir()
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file() or not (out / "tokenizer.json").is_file():
        return build_demo_model(out)
    template = out / "chat_template.jinja"
    if template.is_file() and template.read_text(encoding="utf-8") != CHAT_TEMPLATE:  # built by an older version
        return build_demo_model(out)
    return out
