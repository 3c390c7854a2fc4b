"""The engine's TokenLogprob entries in OpenAI's two shapes (and vLLM's prompt_logprobs).

    [(token id, TokenLogprob | None)] --completion_logprobs--> {tokens, token_logprobs, top_logprobs, text_offset}
                                      --chat_logprobs-------> [{token, logprob, bytes, top_logprobs: [...]}]

Token strings are each id decoded alone (vLLM's ``decoded_token``), or ``token_id:N`` with
``return_tokens_as_token_ids``. Completions' top_logprobs also hold the chosen token, as vLLM's do (so
lm-evaluation-harness can tell whether the continuation was the greedy one); chat's hold exactly the top N.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from moe_offload.engines.base import TokenLogprob


class TokenText:
    """id -> its text, cached (a decode per id per token would cost on long streams)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.as_ids = as_ids
        self._decode = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def __call__(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self._decode(token)


def completion_logprobs(entries: Sequence[tuple[int, TokenLogprob | None]], text: TokenText, offset: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, e in entries:
        s = text(token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:  # the first prompt token: nothing came before it
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(e.logprob)
        top = {text(t): lp for t, lp in e.top}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _item(text: TokenText, token: int, lp: float) -> dict:
    s = text(token)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(entries: Sequence[tuple[int, TokenLogprob | None]], text: TokenText) -> list[dict]:
    return [{**_item(text, t, e.logprob), "top_logprobs": [_item(text, i, lp) for i, lp in e.top]}
            for t, e in entries if e is not None]


def prompt_logprobs(prompt: Sequence[int], entries: Sequence[TokenLogprob | None], text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None or {token id: {logprob, rank, decoded_token}} holding the
    token itself and the top N."""
    out: list[dict | None] = []
    for token, e in zip(prompt, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": text(t)} for r, (t, lp) in enumerate(e.top)}
        d.setdefault(str(token), {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(token)})
        out.append(d)
    return out


def cumulative(entries: Sequence[tuple[int, TokenLogprob | None]]) -> float:
    """Sum of the generated tokens' logprobs: how best_of ranks its runs (as vLLM did)."""
    return sum(e.logprob for _, e in entries if e is not None)
