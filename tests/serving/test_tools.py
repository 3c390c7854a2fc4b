"""Tool-call parsers (hermes, qwen3_coder), streamed and not, and "auto" tool calling end to end through the
openai client on a scripted mock engine (random weights never write a tool call of their own accord)."""

from __future__ import annotations

import json

import openai
import pytest

from moe_offload.engines.base import Generation, GenerationStats
from moe_offload.engines.mock import MockConfig, MockEngine
from moe_offload.serving import tools
from moe_offload.serving.worker import create_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>')
CODER = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


def args(call):
    return json.loads(call["function"]["arguments"])


def test_hermes_and_qwen3_coder_parse():
    content, calls = tools.parse(HERMES, "hermes", [WEATHER])
    assert content == "Let me check.\n" and [args(c) for c in calls] == [{"city": "Paris", "days": 2}, {"city": "Rome", "days": 1}]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    content, calls = tools.parse(CODER, "qwen3_coder", [WEATHER])
    # values take the parameter's schema type: "3" -> 3, "true" -> true, strings stay strings
    assert content == "Checking.\n" and args(calls[0]) == {"city": "New York", "days": 3, "metric": True}
    # a block that is not a call stays text; an unclosed final block (EOS for </tool_call>) still counts
    content, calls = tools.parse("<tool_call>not json</tool_call> rest", "hermes", [WEATHER])
    assert calls == [] and content == "<tool_call>not json</tool_call> rest"
    content, calls = tools.parse('<tool_call>{"name": "get_weather", "arguments": {}}', "hermes", [WEATHER])
    assert content is None and args(calls[0]) == {}


@pytest.mark.parametrize("text, parser", [(HERMES, "hermes"), (CODER, "qwen3_coder")])
def test_streamed_pieces_give_the_same_result(text, parser):
    whole_content, whole_calls = tools.parse(text, parser, [WEATHER])
    for size in (1, 3, 7):
        s = tools.ToolStream(parser, [WEATHER])
        content, calls = "", []
        for i in range(0, len(text), size):
            c, new = s.push(text[i:i + size])
            content, calls = content + c, calls + new
        c, new = s.finish()
        assert content + c == whole_content and [args(x) for x in calls + new] == [args(x) for x in whole_calls]


def test_parser_detected_from_the_template():
    class T:
        chat_template = "{{ '<tool_call>\\n<function=' }}"

    assert tools.detect_parser(T()) == "qwen3_coder"
    T.chat_template = "<tool_call>{{ tool | tojson }}</tool_call>"
    assert tools.detect_parser(T()) == "hermes"


class ToolMock(MockEngine):
    """Replies with a fixed Hermes tool call, byte by byte (the mock tokenizer is UTF-8 bytes)."""

    def __init__(self, reply: str):
        super().__init__(MockConfig(ms_per_token=0))
        self.reply = reply

    def generate(self, prompt_ids, params):
        self.check_prompt(prompt_ids, params)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))

        def run():
            for i, b in enumerate(self.reply.encode()):
                if i >= params.max_tokens:
                    return
                stats.completion_tokens += 1
                yield b
            stats.finish_reason = "stop"

        return Generation(run(), stats)


def test_auto_tool_calls_through_the_openai_client(serve):
    h = serve(create_app(ToolMock(HERMES), model_name="m", tool_parser="hermes"))
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], max_tokens=400)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 1})]
    chunks = list(client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], max_tokens=400, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1] and [json.loads(d.function.arguments) for d in deltas] == [
        json.loads(c.function.arguments) for c in m.tool_calls]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Let me check.\n"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice none: the same reply is plain content
    r = client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=400)
    assert r.choices[0].message.content == HERMES and not r.choices[0].message.tool_calls
    # the mock has no structured output, so a forced call is refused, naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=10)
    assert e.value.body["param"] == "tool_choice"
