"""`moe-offload demo-model | generate | profile` end to end, bad input, and the demo model's determinism."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moe_offload.cli import main


@pytest.fixture(scope="session")
def demo_dir(demo_model_dir):
    return Path(demo_model_dir)


def cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_demo_model_is_deterministic_and_labelled(demo_dir, tmp_path, capsys):
    rc, out, _ = cli(capsys, "demo-model", "--out", str(tmp_path / "again"))
    assert rc == 0 and out.strip() == str(tmp_path / "again")
    assert digest(demo_dir) == digest(tmp_path / "again")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(digest(demo_dir))
    assert "RANDOM WEIGHTS" in json.loads((demo_dir / "config.json").read_text())["moe_offload_note"]
    assert "random" in (demo_dir / "README.md").read_text().lower()


def test_demo_model_into_an_unwritable_place_is_one_clear_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    rc, _, err = cli(capsys, "demo-model", "--out", str(tmp_path / "a-file" / "demo"))
    # was "error: FileNotFoundError: ..." after building the whole model
    assert rc == 1 and err.startswith("error: --out") and "Error:" not in err and err.count("\n") == 1


def test_demo_tokenizer_round_trips_and_chats(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    text = "The porter sends the visitor to the bread room."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generate_json(demo_dir, capsys):
    rc, out, _ = cli(capsys, "generate", "--model", str(demo_dir), "--prompt", "The river runs", "--max-tokens", "6",
                     "--policy", "lru", "--fraction", "0.25", "--ignore-eos", "--json")
    assert rc == 0
    data = json.loads(out)
    assert len(data["token_ids"]) == 6 and isinstance(data["text"], str)
    s = data["stats"]
    assert s["completion_tokens"] == 6 and s["hits"] + s["misses"] > 0 and data["policy"] == "lru"
    assert s["bytes_moved"]["cpu:0"] > 0
    # each decode step's ms (the prefill step gives the first token): their mean is the reported ms/token
    assert len(data["token_ms"]) == 5 and all(t > 0 for t in data["token_ms"])
    assert abs(sum(data["token_ms"]) / 5 - s["decode_ms_per_token"]) < 0.01


def test_generate_takes_the_kv_budget_and_context(demo_dir, capsys):
    rc, out, _ = cli(capsys, "generate", "--model", str(demo_dir), "--prompt", "The river runs", "--max-tokens", "3",
                     "--kv-cache-memory", "32MiB", "--max-model-len", "128", "--json")
    assert rc == 0
    mem = json.loads(out)["memory"]
    assert mem["kv_bytes"] == 32 * 2**20 and "as asked" in mem["reason"]
    rc, _, err = cli(capsys, "generate", "--model", str(demo_dir), "--prompt", "x", "--kv-cache-memory", "1KiB")
    assert rc != 0 and err.startswith("error: kv_cache_memory") and err.count("\n") == 1
    # an int8 cache: labelled approximate in what the user sees
    rc, out, _ = cli(capsys, "generate", "--model", str(demo_dir), "--prompt", "The river runs", "--max-tokens", "3",
                     "--kv-cache-dtype", "int8", "--ignore-eos", "--json")
    assert rc == 0 and json.loads(out)["approximate"]["mode"] == "kv_cache_dtype=int8"
    assert len(json.loads(out)["token_ids"]) == 3


def test_generate_text_sampled_and_chat(demo_dir, capsys):
    args = ("generate", "--model", str(demo_dir), "--prompt", "hello", "--chat", "--max-tokens", "5", "--temperature",
            "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "4", "--ignore-eos")
    rc, out, err = cli(capsys, *args)
    assert rc == 0 and "5 tokens" in err and "ms/token" in err
    assert cli(capsys, *args)[1] == out  # same seed, same text


def test_generate_speculative_keeps_the_tokens_and_reports_acceptance(capsys):
    """On the trained demo (code drafts well from its own context): the same greedy tokens with prompt lookup, the
    acceptance in --json and on the summary line; a bad config is one line before anything loads."""
    base = ("generate", "--prompt", "def fibonacci(n):\n    ", "--max-tokens", "48", "--ignore-eos")
    rc, out, _ = cli(capsys, *base, "--json")
    plain = json.loads(out)
    rc2, out2, _ = cli(capsys, *base, "--json", "--speculative-config", '{"num_speculative_tokens": 3}')
    spec = json.loads(out2)
    assert rc == rc2 == 0 and spec["token_ids"] == plain["token_ids"]
    s = spec["stats"]["speculative"]
    assert s["drafts"] > 0 and s["accepted_tokens"] > 0 and s["mean_acceptance_length"] > 1
    assert len(spec["token_ms"]) == 47  # one entry per token after the first, a verify step's time split over its tokens
    rc, _, err = cli(capsys, *base, "--speculative-config", '{"num_speculative_tokens": 3}')
    assert rc == 0 and "tokens per step" in err
    rc, _, err = cli(capsys, *base, "--speculative-config", '{"method": "medusa"}')
    assert rc != 0 and err.startswith("error: speculative method") and err.count("\n") == 1


def test_generate_defaults_to_the_trained_demo_model(capsys):
    from moe_offload import demo

    rc, out, err = cli(capsys, "generate", "--prompt", "def ", "--max-tokens", "3", "--ignore-eos", "--json")
    assert rc == 0 and "building" not in err
    assert json.loads(out)["model"] == str(demo.trained_dir())


def test_generate_defaults_to_the_random_demo_model_without_the_trained_one(demo_dir, tmp_path, monkeypatch, capsys):
    from moe_offload import demo

    target = tmp_path / "cache" / "demo-model"
    monkeypatch.setattr(demo, "DEFAULT_DIR", target)
    monkeypatch.setattr(demo, "trained_dir", lambda: None)
    rc, out, err = cli(capsys, "generate", "--prompt", "one two", "--max-tokens", "3", "--ignore-eos", "--json")
    assert rc == 0 and "building the demo model" in err
    assert json.loads(out)["model"] == str(target)
    assert digest(target) == digest(demo_dir)


def test_profile_writes_routes(demo_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from moe_offload.control.profile import Profile, load_routes
    from moe_offload.control.spec import ModelSpec

    prompts = ["The river runs past the mill.", "One, two, three.", "What is a slot?"]
    lines = [json.dumps({"prompt": prompts[0], "class": "prose"}), json.dumps({"prompt": prompts[1], "class": "counting"}),
             "", json.dumps({"prompt": prompts[2], "class": "prose"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "routes.safetensors"
    rc, stdout, _ = cli(capsys, "profile", "--model", str(demo_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
                        "--fraction", "0.5")
    assert rc == 0 and "wrote" in stdout
    tok = AutoTokenizer.from_pretrained(demo_dir)
    T = sum(len(tok(p)["input_ids"]) for p in prompts)
    routes = load_routes(out)
    assert routes.ids.shape == (T, 4, 4) and routes.layers == (0, 1, 2, 3) and routes.num_experts == 16
    assert routes.classes == ("prose", "counting") and routes.class_ids.tolist().count(1) == len(tok(prompts[1])["input_ids"])
    # each token's top-k ids are distinct experts
    assert all(len(set(row)) == 4 for tok_rows in routes.ids.tolist() for row in tok_rows)
    Profile.from_routes(routes).check(ModelSpec.from_hf_config(str(demo_dir)))

    # with generated tokens too, as JSON
    rc, stdout, _ = cli(capsys, "profile", "--model", str(demo_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                        str(tmp_path / "r.json"), "--max-tokens", "3", "--json")
    assert rc == 0 and json.loads(stdout)["tokens"] == T + 3 * 2 and load_routes(tmp_path / "r.json").ids.shape == (T + 6, 4, 4)


def _dense_checkpoint(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    path = root / "dense"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _missing_shard(demo_dir: Path, root: Path) -> Path:
    path = root / "sharded"
    path.mkdir()
    shutil.copy(demo_dir / "config.json", path)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return path


def test_bad_input_is_one_line_and_nonzero(demo_dir, tmp_path, capsys, checkpoints):
    from moe_offload.backends import get_backend
    from moe_offload.control import placement
    from moe_offload.control.spec import ModelSpec

    other = tmp_path / "other-placement.json"
    spec = ModelSpec.from_hf_config(checkpoints("qwen3_moe"))
    other.write_text(placement.from_fraction(spec, get_backend("cpu").tiers(), 0.5).to_json())
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    gen = ("generate", "--prompt", "hi", "--max-tokens", "2")
    cases = {
        "missing dir": (*gen, "--model", str(tmp_path / "nope")),
        "missing shard": (*gen, "--model", str(_missing_shard(demo_dir, tmp_path))),
        "dense": (*gen, "--model", str(_dense_checkpoint(tmp_path))),
        "other placement": (*gen, "--model", str(demo_dir), "--placement", str(other)),
        "fraction": (*gen, "--model", str(demo_dir), "--fraction", "1.5"),
        "negative fraction": (*gen, "--model", str(demo_dir), "--fraction", "-0.1"),
        "no placement file": (*gen, "--model", str(demo_dir), "--placement", str(tmp_path / "nope.json")),
        "max tokens": (*gen[:-1], "0", "--model", str(demo_dir)),
        "bad jsonl": ("profile", "--model", str(demo_dir), "--prompts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "r.safetensors")),
        "bad out": ("profile", "--model", str(demo_dir), "--prompts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "r.bin")),
    }
    for name, args in cases.items():
        rc, out, err = cli(capsys, *args)
        lines = err.strip().splitlines()
        assert rc != 0, name
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        assert "Traceback" not in err, name


def test_profile_plan_generate_round_trip(demo_dir, tmp_path, capsys):
    """The profile this command writes feeds `plan`, whose placement feeds `generate --placement`."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "The river runs past the mill and turns the wheel."}\n')
    routes, placement = tmp_path / "routes.json", tmp_path / "placement.json"
    assert cli(capsys, "profile", "--model", str(demo_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(routes))[0] == 0
    rc, _, err = cli(capsys, "plan", "--model", str(demo_dir), "--profile", str(routes), "--fraction", "0.25",
                     "--backend", "cpu", "--out", str(placement))
    assert rc == 0, err
    rc, out, err = cli(capsys, "generate", "--model", str(demo_dir), "--placement", str(placement), "--prompt",
                       "The river runs past the mill", "--max-tokens", "4", "--ignore-eos", "--json")
    assert rc == 0, err
    s = json.loads(out)["stats"]
    assert 0 < s["hits"] and 0 < s["misses"] and s["host_expert_tokens"] == s["misses"]


def test_convert_then_generate_on_the_disk_tier(demo_dir, tmp_path, monkeypatch, capsys):
    """`convert` writes the expert store once; `generate --host-memory` below the experts' size reads them from it,
    with the same tokens as the in-memory run, and reports the disk tier."""
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    rc, out, _ = cli(capsys, "convert", "--model", str(demo_dir), "--json")
    conv = json.loads(out)
    assert rc == 0 and conv["written"] is True
    weights = sum(f.stat().st_size for f in Path(demo_dir).glob("*.safetensors"))
    assert conv["in_place"] is True and 0 < conv["disk_bytes"] < 0.05 * weights  # read in place: the manifest alone
    rc, out, _ = cli(capsys, "convert", "--model", str(demo_dir), "--json")
    assert rc == 0 and json.loads(out)["written"] is False  # found, not written again
    common = ("generate", "--model", str(demo_dir), "--prompt", "The river runs", "--max-tokens", "6", "--ignore-eos")
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "none"))  # no store: the in-memory load
    rc, out, _ = cli(capsys, *common, "--json")
    ref = json.loads(out)["token_ids"]
    monkeypatch.setenv("MOE_OFFLOAD_STORE_DIR", str(tmp_path / "stores"))
    rc, out, _ = cli(capsys, *common, "--host-memory", "8MiB", "--json")
    data = json.loads(out)
    assert rc == 0 and data["token_ids"] == ref
    assert data["experts"]["disk_store_bytes"] > data["experts"]["host_store_bytes"]
    assert data["stats"]["disk"]["disk_reads"] > 0 and data["stats"]["bytes_moved"]["disk"] > 0
    rc, _, err = cli(capsys, *common, "--host-memory", "8MiB", "--no-prefetch")
    assert rc == 0 and "disk tier: host hits" in err and "MB/token" in err
    rc, _, err = cli(capsys, *common, "--host-memory", "1KiB")
    assert rc != 0 and "expected at least" in err and "raise --host-memory" in err


def test_generate_json_reports_each_device_and_each_rank(demo_dir, capsys):
    """--devices cpu,cpu: hits per device tier; --tensor-parallel 2: each rank's own experts' numbers, which add up
    to the request's; both with the one-device run's tokens."""
    base = ("generate", "--model", str(demo_dir), "--prompt", "The river runs", "--max-tokens", "6", "--ignore-eos",
            "--policy", "static", "--fraction", "0.5", "--json")
    runs = {}
    for name, extra in (("one", ()), ("devices", ("--devices", "cpu,cpu")), ("ranks", ("--tensor-parallel", "2"))):
        rc, out, _ = cli(capsys, *base, *extra)
        assert rc == 0, name
        runs[name] = json.loads(out)
    assert runs["devices"]["token_ids"] == runs["ranks"]["token_ids"] == runs["one"]["token_ids"]
    by_tier = runs["devices"]["stats"]["hits_by_tier"]
    assert set(by_tier) == {"cpu:0", "cpu:1"} and all(n > 0 for n in by_tier.values())
    assert sum(by_tier.values()) == runs["devices"]["stats"]["hits"]
    s, ranks = runs["ranks"]["stats"], runs["ranks"]["ranks"]
    assert len(ranks) == 2 and all(r["hits"] > 0 for r in ranks)
    assert sum(r["hits"] for r in ranks) == s["hits"] and sum(r["misses"] for r in ranks) == s["misses"]
    # printed as the request's numbers are: ms to 3 decimals, rates to 6
    assert all(v == round(v, 3) for r in ranks for v in r["stage_ms"].values())
    assert all(r["hit_rate_by_tier"]["cpu:0"] == round(r["hits"] / (r["hits"] + r["misses"]), 6) for r in ranks)
