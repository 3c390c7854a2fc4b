"""Incremental detokenisation with stop strings.

Tokens arrive one at a time; ``push`` returns the text that is safe to send:
a multi-byte character split over tokens is held until complete (vLLM's
prefix/read offsets), and text that might be the start of a stop string is
held until it is not. When a stop string appears the text is cut before it
(after it with ``include_stop``, vLLM's include_stop_str_in_output), ``stop_str``
names it and ``stopped`` turns true (the caller then aborts the generation).
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), *, include_stop: bool = False, skip_special: bool = True):
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop, self.skip_special = include_stop, skip_special
        self.stop_str: str | None = None
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped and self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix:self.read])
            self.text += self._decode(self.ids[self.prefix:])[len(before):]
            self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, self.emitted - longest)
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.stop_str = min(hits)
                self.text = self.text[: at + (len(self.stop_str) if self.include_stop else 0)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            hold = max((k for s in self.stop for k in range(min(len(s) - 1, end), 0, -1) if self.text.endswith(s[:k])), default=0)
            end -= hold
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
