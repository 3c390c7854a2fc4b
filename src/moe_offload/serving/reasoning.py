"""Split ``<think>...</think>`` reasoning from the answer, incrementally (as vLLM's reasoning parsers do).

Text is pushed as it is decoded; each push returns ``(reasoning, content)``
deltas. A tag split across pushes is held back until it is complete. The
reply is in reasoning mode from the start when the chat template already
opened ``<think>`` in the prompt, or when the reply itself begins with it;
everything after ``</think>`` is content. An unclosed ``<think>`` stays
reasoning, so a streamed and a non-streamed reply split identically.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def wants_reasoning(tokenizer) -> bool:
    """True when the tokenizer's chat template knows ``<think>`` (Qwen3, DeepSeek-R1 style models)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    return isinstance(template, str) and START in template


class ReasoningSplitter:
    def __init__(self, prompt_text: str = ""):
        self.mode = "reasoning" if prompt_text.rstrip().endswith(START) else "start"
        self.buf = ""
        self._strip_lead = False  # newlines right after </think> are layout, not content

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.mode == "start":
                s = self.buf.lstrip()
                if s.startswith(START):
                    self.mode, self.buf = "reasoning", s[len(START):]
                    continue
                if START.startswith(s):  # maybe the tag is still coming
                    break
                self.mode = "content"
            elif self.mode == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.mode, self.buf, self._strip_lead = "content", self.buf[i + len(END):], True
                    continue
                keep = _partial_suffix(self.buf, END)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                if self._strip_lead:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        break
                    self._strip_lead = False
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return rest, ""
        return "", rest.lstrip("\n") if self._strip_lead else rest


def split(text: str, prompt_text: str = "") -> tuple[str, str]:
    """Whole-text split: ``(reasoning, content)``."""
    s = ReasoningSplitter(prompt_text)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
