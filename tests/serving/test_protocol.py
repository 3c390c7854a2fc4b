"""Request validation (strict types, params named as clients name them, refused fields) and generation_config defaults."""

from __future__ import annotations

import json

import pytest

from moe_offload.errors import ConfigError
from moe_offload.serving import defaults
from moe_offload.serving.errors import APIError
from moe_offload.serving.protocol import REFUSED, ChatCompletionRequest, CompletionRequest, param_of, validate


def test_param_names_drop_union_tags():
    assert param_of(("messages", 0, "role")) == "messages[0].role"
    assert param_of(("stop", "list[str]", 3)) == "stop[3]"
    assert param_of(("prompt", "function-after[x]", 0)) == "prompt[0]"
    assert param_of(()) is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),  # strict: a string is not an integer
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
    ({"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_bad_fields_are_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        validate(CompletionRequest, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param


def test_unknown_fields_are_ignored_and_known_ones_typed():
    req = validate(CompletionRequest, b'{"prompt": "x", "frobnicate": 1, "logit_bias": {"5": -3}}')
    assert req.model_extra == {"frobnicate": 1} and req.logit_bias == {"5": -3.0}
    chat = validate(ChatCompletionRequest, json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                                       "tool_choice": {"type": "function", "function": {"name": "f"}}}).encode())
    assert chat.messages[0].content[0].text == "hi" and chat.tool_choice.function.name == "f"
    assert {"suffix", "use_beam_search", "truncate_prompt_tokens"} <= set(REFUSED)


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 512, "do_sample": True}))
    # values equal to transformers' defaults (top_p 1.0) are not overrides, as in vLLM
    assert defaults.load("auto", str(tmp_path)) == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 512}
    assert defaults.load("vllm", str(tmp_path)) == {} and defaults.load("auto", str(tmp_path / "none")) == {}
    assert defaults.load(str(tmp_path)) == defaults.load("auto", str(tmp_path))
    with pytest.raises(ConfigError, match="generation-config"):
        defaults.load(str(tmp_path / "missing"))
