"""Request classes: a cheap, documented guess of which experts a request will route to.

A class is ``<script>-<kind>``:

* script: ``hangul`` (Hangul syllables and jamo), ``cjk`` (Han ideographs,
  kana), else ``latin`` (Latin letters, and every other script or none). The
  script with the most letters in the text wins; ties go to ``latin``.
* kind: ``code`` when the text has a Markdown code fence, a line that starts
  like code (``def``, ``class``, ``import``, ``#include``, ``function``, ...),
  or when at least 8 % of its non-space characters are code punctuation
  (``{}()[];=<>``); else ``prose``.

Only the first 4096 characters are read, so classifying costs microseconds.
Token-id prompts (no text) are ``latin-prose``.
"""

from __future__ import annotations

import re

SCRIPTS = ("hangul", "cjk", "latin")
KINDS = ("prose", "code")
CLASSES = tuple(f"{s}-{k}" for s in SCRIPTS for k in KINDS)
DEFAULT_CLASS = "latin-prose"
MAX_CHARS = 4096
CODE_PUNCT_FRACTION = 0.08

_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |#include|function |fn |func |package |public |private |"
    r"const |let |var |return |if \(|for \(|while \(|SELECT |CREATE TABLE)",
    re.MULTILINE,
)
_CODE_PUNCT = frozenset("{}()[];=<>")


def _script(ch: str) -> str | None:
    o = ord(ch)
    if 0xAC00 <= o <= 0xD7A3 or 0x1100 <= o <= 0x11FF or 0x3130 <= o <= 0x318F:
        return "hangul"
    if 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x3040 <= o <= 0x30FF or 0xF900 <= o <= 0xFAFF:
        return "cjk"
    if ch.isalpha():
        return "latin"
    return None


def script_of(text: str) -> str:
    counts = {"hangul": 0, "cjk": 0, "latin": 0}
    for ch in text[:MAX_CHARS]:
        s = _script(ch)
        if s:
            counts[s] += 1
    best = max(SCRIPTS, key=lambda s: (counts[s], s == "latin"))
    return best if counts[best] else "latin"


def is_code(text: str) -> bool:
    text = text[:MAX_CHARS]
    if "```" in text or _CODE_LINE.search(text):
        return True
    visible = [c for c in text if not c.isspace()]
    if len(visible) < 8:
        return False
    return sum(c in _CODE_PUNCT for c in visible) / len(visible) >= CODE_PUNCT_FRACTION


def classify(text: str) -> str:
    """The class of a request's text, one of ``CLASSES``."""
    if not text:
        return DEFAULT_CLASS
    return f"{script_of(text)}-{'code' if is_code(text) else 'prose'}"


def request_text(body: object) -> str:
    """The text of an OpenAI completions or chat body that classification reads (first MAX_CHARS)."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts.extend(p for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)[:MAX_CHARS]
