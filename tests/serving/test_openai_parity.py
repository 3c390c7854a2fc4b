"""OpenAI/vLLM API parity on the demo model (random weights, cpu backend) through the official openai client:
logprobs, echo, penalties, min_p / min_tokens / logit_bias, stop strings, generation_config defaults, n and
best_of, structured output, tools, /tokenize. Every response body validates against the client's own types
(pydantic validation, not the client's lenient construction) and the worker's response models."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from moe_offload.serving import responses as R
from moe_offload.serving.worker import create_app

PROMPT = "The river runs under the old stone bridge"
USER = [{"role": "user", "content": "Tell me about the river."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["river", "expert"]}, "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def demo(demo_model_dir):
    """One worker on the demo model for the module; (url, openai client, tokenizer, checkpoint dir)."""
    from moe_offload.backends import get_backend
    from moe_offload.serving.server import start_server

    engine = get_backend("cpu").build_engine(str(demo_model_dir), fraction=0.5, policy="static")
    h = start_server(create_app(engine, model_name="demo"), "127.0.0.1", 0)
    try:
        yield h.url, openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0), engine.tokenizer, demo_model_dir
    finally:
        h.stop()


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sse(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(url + path, json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    lines = [l[6:] for l in r.text.splitlines() if l.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(l) for l in lines[:-1]]
    for ch in chunks:  # each event validates against the client's types and ours
        if path.endswith("chat/completions"):
            ChatCompletionChunk.model_validate(ch)
            R.ChatCompletionChunk.model_validate(ch)
        else:
            # The SDK types a completion choice's finish_reason as never null; a mid-stream chunk carries null
            # (as OpenAI's own stream does), so those chunks are checked against our model only.
            if all(c["finish_reason"] is not None for c in ch["choices"]):
                Completion.model_validate(client_view(ch))
            R.CompletionChunk.model_validate(ch)
    return chunks


def client_view(out: dict) -> dict:
    """The body as the client's types admit it. With echo, the first prompt token has no logprob: OpenAI's own
    API (and vLLM) send null there, while the SDK types the lists as floats; only that entry is left out."""
    out = json.loads(json.dumps(out))
    for ch in out["choices"]:
        lp = ch.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[k] = lp[k][1:]
    return out


def completion(url, **body) -> dict:
    out = post(url, "/v1/completions", {"model": "demo", **body})
    Completion.model_validate(client_view(out))
    R.CompletionResponse.model_validate(out)
    return out


def chat(url, **body) -> dict:
    out = post(url, "/v1/chat/completions", {"model": "demo", **body})
    ChatCompletion.model_validate(out)
    R.ChatCompletionResponse.model_validate(out)
    return out


@pytest.fixture(scope="module")
def stock_logprobs(demo):
    """transformers' own fp32 log_softmax over a prompt + continuation on the demo checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(demo[3])).eval()

    def run(ids):
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]

    return run


# -- logprobs -----------------------------------------------------------------------------------------------
def test_completion_logprobs_echo_exact_and_streamed(demo, stock_logprobs):
    url, client, tok, _ = demo
    ids = tok.encode(PROMPT, add_special_tokens=False)
    c = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert c.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    body = completion(url, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, echo=True, ignore_eos=True, return_token_ids=True)
    gen = body["choices"][0]["token_ids"]
    ref = stock_logprobs(ids + gen)  # position t predicts token t + 1
    got = body["choices"][0]["logprobs"]["token_logprobs"]
    want = [None] + [float(ref[t - 1, tok_id]) for t, tok_id in enumerate(ids + gen) if t > 0]
    # fp32 on both sides; the executor's expert GEMMs and transformers' grouped_mm sum in another order (1e-5)
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-5)
    for t, top in enumerate(body["choices"][0]["logprobs"]["top_logprobs"][1:], start=1):
        assert len(top) in (3, 4)  # the top 3, plus the token itself when it is not among them (as vLLM)
        assert max(top.values()) == pytest.approx(float(ref[t - 1].max()), abs=1e-5)
    # greedy: each generated token is the most likely one
    assert all(lp_ == pytest.approx(float(ref[len(ids) - 1 + i].max()), abs=1e-5) for i, lp_ in enumerate(got[len(ids):]))
    # streamed: the same tokens and logprobs, spread over the chunks
    chunks = sse(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True,
                                          "ignore_eos": True})
    tokens = [t for ch in chunks for choice in ch["choices"] if choice["logprobs"] for t in choice["logprobs"]["tokens"]]
    assert tokens == body["choices"][0]["logprobs"]["tokens"]
    assert "".join(choice["text"] for ch in chunks for choice in ch["choices"]) == body["choices"][0]["text"]
    # echo with max_tokens 0: the prompt's logprobs only (what log-likelihood evaluations ask)
    only = completion(url, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert only["choices"][0]["text"] == PROMPT and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"] == got[: len(ids)]


def test_chat_logprobs_stream_and_not(demo):
    url, client, _, _ = demo
    msg = client.chat.completions.create(model="demo", messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = msg.choices[0].logprobs.content
    assert len(content) == msg.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy
    assert "".join(c.token for c in content) == msg.choices[0].message.content
    chunks = list(client.chat.completions.create(model="demo", messages=USER, max_tokens=5, temperature=0, logprobs=True,
                                                 top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    sse(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "logprobs": True, "top_logprobs": 2})


# -- sampling parity ----------------------------------------------------------------------------------------
def test_repetition_penalty_matches_transformers(demo):
    from transformers import AutoModelForCausalLM

    url, _, tok, path = demo
    ids = tok.encode(PROMPT, add_special_tokens=False)
    body = completion(url, prompt=ids, max_tokens=12, temperature=0, repetition_penalty=1.5, ignore_eos=True, return_token_ids=True)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.inference_mode():  # transformers' RepetitionPenaltyLogitsProcessor: the same rule over prompt + output
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                             eos_token_id=None, pad_token_id=0)
    assert body["choices"][0]["token_ids"] == out[0, len(ids):].tolist()
    plain = completion(url, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    assert plain["choices"][0]["token_ids"] != body["choices"][0]["token_ids"]  # the penalty changed something


def test_logit_bias_min_tokens_min_p_and_presence(demo):
    url, _, tok, _ = demo
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # a huge EOS bias ends the reply at once; min_tokens holds EOS back for exactly that many tokens
    assert completion(url, prompt=PROMPT, max_tokens=10, logit_bias={str(eos): 100})["usage"]["completion_tokens"] == 0
    held = completion(url, prompt=PROMPT, max_tokens=10, logit_bias={str(eos): 100}, min_tokens=3)
    assert held["usage"]["completion_tokens"] == 3 and held["choices"][0]["finish_reason"] == "stop"
    # min_p 1 keeps only the most likely token: sampling is greedy whatever the seed
    greedy = completion(url, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)["choices"][0]["text"]
    assert completion(url, prompt=PROMPT, max_tokens=8, temperature=1.0, min_p=1.0, seed=5, ignore_eos=True)["choices"][0]["text"] == greedy
    pres = completion(url, prompt=PROMPT, max_tokens=16, temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                      ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
    base = completion(url, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
    assert len(set(pres)) >= len(set(base))  # penalising repeats never makes the greedy reply less varied here


def test_stop_string_kept_with_include_stop_str_in_output(demo):
    url, _, _, _ = demo
    full = completion(url, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = full[6:9]
    cut = completion(url, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert cut["choices"][0]["text"] == full[: full.index(stop) + len(stop)] and cut["choices"][0]["stop_reason"] == stop
    streamed = sse(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
                                            "include_stop_str_in_output": True})
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == cut["choices"][0]["text"]


def test_generation_config_defaults_apply_when_omitted(demo, tmp_path, serve):
    from moe_offload.backends import get_backend

    url, _, _, path = demo
    model = tmp_path / "model"
    shutil.copytree(path, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.0, "repetition_penalty": 1.5}))
    engine = get_backend("cpu").build_engine(str(model), fraction=1.0)
    h = serve(create_app(engine, model_name="demo"))
    body = {"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}
    # the model says greedy with a repetition penalty: a request that omits both gets exactly that
    want = completion(url, **body, temperature=0, repetition_penalty=1.5)["choices"][0]["text"]
    assert completion(h.url, **body)["choices"][0]["text"] == want
    # a request's own values win
    assert completion(h.url, **body, repetition_penalty=1.0)["choices"][0]["text"] == completion(url, **body, temperature=0)["choices"][0]["text"]
    h2 = serve(create_app(get_backend("cpu").build_engine(str(model), fraction=1.0), model_name="demo", generation_config="vllm"))
    seeded = completion(h2.url, **body, seed=3)["choices"][0]["text"]  # OpenAI's default temperature 1.0: sampled
    assert seeded == completion(url, **body, seed=3, temperature=1.0)["choices"][0]["text"]


def test_n_and_best_of(demo):
    url, client, _, _ = demo
    c = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11, n=3,
                                  extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1, 2] and c.usage.completion_tokens == 18
    for j, ch in enumerate(c.choices):  # choice j is the run with seed + j
        alone = completion(url, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11 + j, ignore_eos=True)
        assert ch.text == alone["choices"][0]["text"]
    runs = [completion(url, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=20 + j, ignore_eos=True, logprobs=0)["choices"][0]
            for j in range(3)]
    best = max(runs, key=lambda r: sum(r["logprobs"]["token_logprobs"]))
    b = completion(url, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=20, best_of=3, ignore_eos=True)
    assert [ch["text"] for ch in b["choices"]] == [best["text"]] and b["choices"][0]["logprobs"] is None
    chunks = list(client.chat.completions.create(model="demo", messages=USER, max_tokens=4, n=2, seed=1, stream=True))
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}


# -- structured output --------------------------------------------------------------------------------------
def test_response_format_json_schema_and_json_object(demo):
    url, client, _, _ = demo
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in (0, 1):
        msg = client.chat.completions.create(model="demo", messages=USER, max_tokens=80, temperature=1.0, seed=seed, response_format=rf)
        # random weights: only the grammar mask makes this JSON; the grammar also ends the reply
        assert msg.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(msg.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model="demo", messages=USER, max_tokens=80, temperature=1.0, seed=2,
                                                 response_format=rf, stream=True))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), SCHEMA)
    obj = chat(url, messages=USER, max_tokens=120, temperature=0, response_format={"type": "json_object"})
    if obj["choices"][0]["finish_reason"] == "stop":  # an object may nest deeper than max_tokens allows; when it ends, it parses
        assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    out = completion(url, prompt=PROMPT, max_tokens=20, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
    assert __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", out["choices"][0]["text"])
    assert completion(url, prompt=PROMPT, max_tokens=8, guided_choice=["yes", "no"])["choices"][0]["text"] in ("yes", "no")
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# -- tools --------------------------------------------------------------------------------------------------
def test_named_and_required_tool_choice(demo):
    url, client, _, _ = demo
    named = {"type": "function", "function": {"name": "get_weather"}}
    msg = client.chat.completions.create(model="demo", messages=USER, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=60, seed=0)
    call = msg.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and msg.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="demo", messages=USER, tools=[WEATHER, CLOCK], tool_choice=named,
                                                 max_tokens=60, seed=0, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    # the first delta opens the call (its id, type and name), as OpenAI streams one; the rest carry arguments only
    first = deltas[0]
    assert first.function.name == "get_weather" and first.type == "function" and first.index == 0
    assert first.id.startswith("chatcmpl-tool-") and first.id != call.id  # a call of another request: its own id
    assert all(d.id in (None, first.id) and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # same seed: same call
    sse(url, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": named, "max_tokens": 60})
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    one = chat(url, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, max_tokens=60, seed=3)
    calls = one["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and one["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), by_name[calls[0]["function"]["name"]])
    many = chat(url, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60, seed=3)["choices"][0]
    if many["finish_reason"] == "tool_calls":
        for c in many["message"]["tool_calls"]:
            jsonschema.validate(json.loads(c["function"]["arguments"]), by_name[c["function"]["name"]])
    else:  # random weights may list calls past max_tokens: the cut JSON is kept as content, not dropped
        assert many["finish_reason"] == "length" and many["message"]["content"].startswith('[{"name":')
    none = chat(url, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert none["choices"][0]["message"].get("tool_calls") in ([], None)


def test_tool_history_reaches_the_template(demo):
    url, client, tok, _ = demo
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    t = post(url, "/tokenize", {"messages": history, "tools": [WEATHER], "return_token_strs": True})
    text = post(url, "/detokenize", {"tokens": t["tokens"]})["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in text  # the call, arguments as an object
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    msg = client.chat.completions.create(model="demo", messages=history, tools=[WEATHER], max_tokens=3)
    assert msg.usage.prompt_tokens == t["count"] and len(t["token_strs"]) == t["count"]


# -- tokenize, prompt_token_ids, openapi --------------------------------------------------------------------
def test_tokenize_detokenize_prompt_token_ids_and_openapi(demo):
    url, _, tok, _ = demo
    t = post(url, "/tokenize", {"prompt": PROMPT})
    assert t["tokens"] == tok.encode(PROMPT) and t["count"] == len(t["tokens"]) and t["max_model_len"] == 2048
    assert post(url, "/detokenize", {"tokens": t["tokens"]})["prompt"] == PROMPT
    a = completion(url, prompt_token_ids=t["tokens"], max_tokens=5, temperature=0)
    assert a["choices"][0]["text"] == completion(url, prompt=PROMPT, max_tokens=5, temperature=0)["choices"][0]["text"]
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "<tool_call>" in info["chat_template"]
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert "best_of" in schemas["CompletionRequest"]["properties"] and "tools" in schemas["ChatCompletionRequest"]["properties"]
    assert httpx.get(url + "/docs").status_code == 200
