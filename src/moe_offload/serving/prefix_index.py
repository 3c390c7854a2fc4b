"""The gateway's view of each worker's prefix cache: which prompt prefixes it was sent recently.

    request body --prefix_text (roles and contents in order, or the prompt)--> text
      --chain: blake2b over each full CHUNK characters and the chunk before--> chunk hashes
    score bonus(worker) = weight x (leading chunks the worker was sent) / (the request's chunks)
    after a worker answers 200: its index takes the request's chunks (LRU, ``capacity`` chunks a worker)

The gateway has no tokenizer, so it estimates from characters what the worker's block cache holds, as llm-d's
approximate prefix-cache scorer does; a worker evicts blocks the index may still list (and the index forgets
chunks a worker still holds), so the bonus is a preference, never a guarantee. A worker that goes away is
forgotten.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK = 256  # characters per chunk: ~64 tokens of prose, four KV blocks of 16
MAX_TEXT = 1 << 20  # characters of a request that are indexed


def prefix_text(body: object) -> str:
    """What a worker's prompt begins with, in order: a chat's roles and contents, or a completion's prompt."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{m.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        parts.append(",".join(map(str, prompt)))
    return "".join(parts)[:MAX_TEXT]


def chain(text: str, model: str | None = None) -> list[bytes]:
    """Hashes of the text's full chunks, each over the chunk and the hash before (the model roots the chain)."""
    parent = hashlib.blake2b((model or "").encode(), digest_size=16).digest()
    out = []
    for i in range(len(text) // CHUNK):
        parent = hashlib.blake2b(parent + text[i * CHUNK : (i + 1) * CHUNK].encode(), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Per worker URL, the chunk hashes it was sent, least recently used first."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.workers: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, url: str, hashes: list[bytes]) -> int:
        """Leading chunks of ``hashes`` that ``url`` was sent."""
        seen = self.workers.get(url)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, url: str, hashes: list[bytes]) -> None:
        seen = self.workers.setdefault(url, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, url: str) -> None:
        self.workers.pop(url, None)
