"""lm-evaluation-harness against the worker on the demo model: a log-likelihood task through local-completions
(prompt logprobs with echo, the remote tokenizer over /tokenizer_info and /tokenize) and generation tasks through
local-completions and local-chat-completions. The datasets are written here; nothing is downloaded (offline).
Scores on random weights are meaningless: the test is that every request is answered and parsed."""

from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [("The river runs", [" under the bridge", " to the sea", " expert"], 1),
             ("Tokens route to", [" experts", " memory", " the host"], 0),
             ("The cache keeps", [" hot experts", " cold water"], 0)]

MC_TASK = """task: moe_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "tiny.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "mc.yaml").write_text(MC_TASK.format(data=data))
    (root / "gen.yaml").write_text(GEN_TASK.format(name="moe_tiny_gen", data=data))
    (root / "gen_chat.yaml").write_text(GEN_TASK.format(name="moe_tiny_gen_chat", data=data))
    return root


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    from moe_offload.backends import get_backend
    from moe_offload.serving.server import start_server
    from moe_offload.serving.worker import create_app

    engine = get_backend("cpu").build_engine(str(demo_model_dir), fraction=0.5, policy="static")
    h = start_server(create_app(engine, model_name="demo"), "127.0.0.1", 0)
    yield h.url
    h.stop()


def evaluate(monkeypatch, task_dir, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")  # a download attempt fails the test instead of reaching out
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    return simple_evaluate(task_manager=TaskManager(include_path=str(task_dir)), log_samples=False, **kw)


def test_loglikelihood_and_generation_through_local_completions(worker, tasks, monkeypatch):
    out = evaluate(monkeypatch, tasks, model="local-completions", tasks=["moe_tiny_mc", "moe_tiny_gen"],
                   model_args=f"base_url={worker}/v1/completions,model=demo,num_concurrent=1,max_retries=1,tokenizer_backend=remote")
    acc = out["results"]["moe_tiny_mc"]["acc,none"]
    em = out["results"]["moe_tiny_gen"]["exact_match,none"]
    assert 0 <= acc <= 1 and not math.isnan(acc) and 0 <= em <= 1  # computed from the worker's logprobs and texts
    assert out["n-samples"]["moe_tiny_mc"]["effective"] == len(QUESTIONS)


def test_generation_through_local_chat_completions(worker, tasks, monkeypatch):
    out = evaluate(monkeypatch, tasks, model="local-chat-completions", tasks=["moe_tiny_gen_chat"], apply_chat_template=True,
                   model_args=f"base_url={worker}/v1/chat/completions,model=demo,num_concurrent=1,max_retries=1")
    assert 0 <= out["results"]["moe_tiny_gen_chat"]["exact_match,none"] <= 1
