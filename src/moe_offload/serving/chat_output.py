"""An assistant reply as it is decoded -> chat deltas: reasoning, content, tool calls.

    text pieces --ReasoningSplitter--> (reasoning, content)
        content --tool_mode none-----> content
                --auto------------> ToolStream(parser): content before the first call + complete calls
                --named-----------> the text is the call's arguments, streamed as they come
                --required--------> buffered; at the end a JSON array of {name, parameters} -> calls

``push`` and ``finish`` return one delta dict each; a non-streamed reply is the merge of the same deltas
(``message()``), so streaming and not always agree.
"""

from __future__ import annotations

from moe_offload.serving import tools as toolcalls
from moe_offload.serving.reasoning import ReasoningSplitter


class ChatOutput:
    def __init__(self, req, reasoning: bool, parser: str):
        self.req = req
        self.splitter = ReasoningSplitter(req.prompt_texts[0] if req.prompt_texts else "") if reasoning else None
        self.mode = req.tool_mode
        self.stream = toolcalls.ToolStream(parser, req.tools) if self.mode == "auto" else None
        self.buffer = ""
        self.calls: list[dict] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []

    def push(self, text: str) -> dict:
        r, c = self.splitter.push(text) if self.splitter else ("", text)
        return self._delta(r, c, final=False)

    def finish(self) -> dict:
        r, c = self.splitter.finish() if self.splitter else ("", "")
        return self._delta(r, c, final=True)

    def _delta(self, r: str, c: str, final: bool) -> dict:
        delta: dict = {}
        if r and self.req.include_reasoning:
            self.reasoning.append(r)
            delta["reasoning"] = r
        new_calls: list[dict] = []
        if self.mode == "auto":
            c, new_calls = self.stream.push(c)
            if final:
                c2, calls2 = self.stream.finish()
                c, new_calls = c + c2, new_calls + calls2
        elif self.mode == "named":
            if not self.calls:
                self.calls.append(toolcalls.as_call(self.req.named_tool, ""))
                first = self.calls[0]
                delta["tool_calls"] = [{"index": 0, "id": first["id"], "type": "function",
                                        "function": {"name": self.req.named_tool, "arguments": c}}]
            elif c:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": c}}]
            self.calls[0]["function"]["arguments"] += c
            return delta
        elif self.mode == "required":
            self.buffer += c
            c = ""
            if final:
                parsed = toolcalls.parse_required(self.buffer)
                if parsed is None:  # cut short by max_tokens: what was written stays visible as content
                    c = self.buffer
                else:
                    new_calls = parsed
        if c:
            self.content.append(c)
            delta["content"] = c
        if new_calls:
            delta["tool_calls"] = [{"index": len(self.calls) + k, **call} for k, call in enumerate(new_calls)]
            self.calls += new_calls
        return delta

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's "tool_calls" when the model called tools of its own accord (auto) or was made to (required);
        a named call keeps the engine's reason, as vLLM does."""
        return "tool_calls" if self.calls and self.mode in ("auto", "required") else engine_reason

    def message(self) -> dict:
        content = "".join(self.content)
        return {"role": "assistant", "content": None if self.calls and not content.strip() else content,
                "reasoning": "".join(self.reasoning) or None, "tool_calls": self.calls}
