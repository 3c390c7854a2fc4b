"""Tool calling: the model's own chat template renders the tools; its reply is parsed back into OpenAI tool_calls.

    tools + messages (with assistant tool_calls and tool results) --chat template--> prompt
    tool_choice "none"     : the reply is content
                "auto"     : reply --ToolStream(parser)--> content deltas + complete tool calls
                "required" : output constrained to REQUIRED_SCHEMA (a JSON array of {name, parameters}) --> tool calls
                named      : output constrained to the function's parameter schema --> one call, arguments = the text

Parsers (vLLM's names): ``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes,
Qwen2.5, Qwen3); ``qwen3_coder`` reads ``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``
(Qwen3-Coder). Content is the text before the first tool call, as vLLM's parsers return it. A block that does
not parse stays content, so nothing the model wrote is lost. Streaming and non-streaming run the same ToolStream,
so they agree.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

PARSERS = ("hermes", "qwen3_coder")
START, END = "<tool_call>", "</tool_call>"


def detect_parser(tokenizer) -> str:
    """The parser matching a chat template: Qwen3-Coder's XML when the template writes ``<function=``, else Hermes."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    return "qwen3_coder" if isinstance(template, str) and "<function=" in template else "hermes"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def as_call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _param_types(tools: Sequence[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return ((t["function"].get("parameters") or {}).get("properties") or {})
    return {}


def parse_block(block: str, parser: str, tools: Sequence[dict]) -> dict | None:
    """One ``<tool_call>`` body -> an OpenAI tool call, or None when it does not parse."""
    if parser == "hermes":
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return as_call(obj["name"], args)
    m = re.fullmatch(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", block, re.S)
    if not m:
        return None
    name, body = m.group(1), m.group(2)
    types = _param_types(tools, name)
    args = {}
    for pm in re.finditer(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", body, re.S):
        key, raw = pm.group(1), pm.group(2)
        kind = (types.get(key) or {}).get("type", "string")
        if kind == "string":
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
    return as_call(name, args)


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolStream:
    """Incremental parse of an "auto" reply: ``push(text)`` and ``finish()`` return (content delta, new calls)."""

    def __init__(self, parser: str, tools: Sequence[dict]):
        self.parser, self.tools = parser, list(tools)
        self.buf = ""
        self.in_call = False
        self.seen_call = False  # after the first call, text outside blocks is not content (vLLM's rule)
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = [], []
        while True:
            if not self.in_call:
                i = self.buf.find(START)
                if i < 0:
                    keep = _partial(self.buf, START)
                    out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if not self.seen_call:
                        content.append(out)
                    break
                if not self.seen_call:
                    content.append(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(START):], True
            else:
                j = self.buf.find(END)
                if j < 0:
                    break
                block, self.buf, self.in_call = self.buf[:j], self.buf[j + len(END):], False
                call = parse_block(block, self.parser, self.tools)
                if call is None:  # not a call after all: the model's text, kept
                    if not self.seen_call:
                        content.append(START + block + END)
                else:
                    self.seen_call = True
                    calls.append(call)
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the reply: an unclosed block is parsed if it can be (EOS may stand for the closing tag)."""
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            call = parse_block(rest, self.parser, self.tools)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            rest = START + rest
        return ("" if self.seen_call else rest), []


def parse(text: str, parser: str, tools: Sequence[dict]) -> tuple[str | None, list[dict]]:
    """A whole "auto" reply -> (content or None, tool calls)."""
    s = ToolStream(parser, tools)
    c1, _ = s.push(text)
    c2, _ = s.finish()
    content = c1 + c2
    return (None if s.calls and not content.strip() else content), s.calls


def required_schema(tools: Sequence[dict], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one or more {"name", "parameters"} objects (vLLM's shape)."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[dict] | None:
    """The constrained output of tool_choice "required" -> tool calls (None if cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [as_call(i["name"], i.get("parameters", {})) for i in items if isinstance(i, dict) and "name" in i]
