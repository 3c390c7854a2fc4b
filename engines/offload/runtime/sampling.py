"""Sampling for a batch of sequences: vLLM's sampling parameters per row, one torch.Generator per row, logprobs.

    logits [B, V] (any float dtype) --float32--> raw
      raw --log_softmax--> logprobs: the chosen token's, its rank, the top N      (rows with params.logprobs)
      raw --grammar mask--> --min_tokens: no EOS/stop ids--> --logit_bias--> --penalties--> processed
      processed --greedy rows------------------------------------------------------> argmax
                --sampled rows: / temperature -> min_p -> top_k -> top_p -> softmax -> exponential race with
                  the row's generator (argmax of p / q, q ~ Exp(1): a draw from p, one generator per row)
    -> [(token, TokenLogprob | None)] per row;  then SequenceState.accept(token) per row

B rows (sequences), V vocabulary, T prompt tokens, N top logprobs.

The order follows vLLM's sampler (structured-output mask, then min_tokens and logit_bias, then repetition,
frequency and presence penalties, then temperature, min_p, top-k, top-p). Logprobs are vLLM's default
"raw" logprobs: the fp32 log_softmax of the model's logits before any of those steps, so they are the
model's own distribution whatever the sampling settings (a grammar can pick a token the model finds unlikely;
its logprob says so). One call serves a batched step; the single-sequence decode loop calls it with B = 1.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from moe_offload.engines.base import TokenLogprob
from moe_offload.engines.params import SamplingParams

PROMPT_LOGPROB_CHUNK = 256  # prompt positions per log_softmax: bounds the fp32 [chunk, V] temporary


class SequenceState:
    """What sampling needs to remember about one sequence: its parameters, random stream, token counts and
    grammar position. ``accept(token)`` after each sampled token."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], *, vocab_size: int, device: torch.device | str = "cpu",
                 eos_ids: Sequence[int] = (), matcher=None):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.matcher = matcher
        self.generated = 0
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        # min_tokens holds back every id that would end the sequence (vLLM: EOS unless ignore_eos, and stop ids).
        self.stop_ids = tuple(dict.fromkeys([*params.stop_token_ids, *(() if params.ignore_eos else eos_ids)]))
        self.bias = None
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
            if int(ids.max()) >= vocab_size:
                from moe_offload.errors import ConfigError

                raise ConfigError(f"logit_bias: expected token ids in 0..{vocab_size - 1}, got {int(ids.max())}")
            self.bias = (ids.to(self.device), torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=self.device))
        self.counts = None  # [V] output token counts (frequency / presence penalties)
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        self.seen = None  # [V] bool: in the prompt or the output (repetition penalty)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self.seen[torch.tensor(list(prompt), dtype=torch.long, device=self.device)] = True

    @property
    def processes(self) -> bool:
        """Whether the logits change before the pick (else greedy is the raw argmax)."""
        p = self.params
        return (self.matcher is not None or self.bias is not None or self.counts is not None or self.seen is not None
                or (p.min_tokens > self.generated and bool(self.stop_ids)))

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the sequence ends here."""
        return self.matcher is not None and self.matcher.finished

    def accept(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.matcher is not None:
            self.matcher.consume(token)

    def process(self, x: torch.Tensor) -> None:
        """Apply this row's mask, min_tokens, bias and penalties to ``x`` [V] fp32, in place."""
        p = self.params
        if self.matcher is not None:
            x.masked_fill_(~_unpack_bitmask(self.matcher.bitmask(), x.shape[-1], x.device), float("-inf"))
        if p.min_tokens > self.generated and self.stop_ids:
            x[torch.tensor(self.stop_ids, dtype=torch.long, device=x.device)] = float("-inf")
        if self.bias is not None:
            x.index_add_(0, self.bias[0], self.bias[1])
        if self.seen is not None:
            rp = p.repetition_penalty
            x.copy_(torch.where(self.seen, torch.where(x > 0, x / rp, x * rp), x))
        if self.counts is not None:
            x.sub_(p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).float())


def _unpack_bitmask(mask: bytes, vocab: int, device) -> torch.Tensor:
    """llguidance's bitmask (bit i of little-endian word w = token 32w + i) -> bool [V]."""
    bits = torch.frombuffer(bytearray(mask), dtype=torch.uint8)  # [ceil(V/32) * 4]
    shifts = torch.arange(8, dtype=torch.uint8)
    allowed = ((bits.unsqueeze(1) >> shifts) & 1).flatten()[:vocab].bool()  # [V]
    if allowed.numel() < vocab:  # logit rows beyond the tokenizer's ids: never allowed
        allowed = torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])
    return allowed.to(device)


def _filter(x: torch.Tensor, rows: Sequence[SequenceState]) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p on ``x`` [S, V] fp32 (sampled rows only) -> probabilities [S, V]."""
    dev = x.device
    temp = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)  # [S, 1]
    x = x / temp
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)  # [S, 1]
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = x.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)  # [S, 1]
    if any(k < vocab for k in top_k) or bool((top_p < 1).any()):
        values, order = torch.sort(x, dim=-1, descending=True)  # [S, V]
        k = torch.tensor(top_k, dtype=torch.long, device=dev).unsqueeze(1)  # [S, 1]
        keep = torch.arange(vocab, device=dev).unsqueeze(0) < k  # [S, V]: the k largest
        values = values.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(values, dim=-1)
        # Keep a token while the mass before it is below top_p: the most likely token is always kept.
        keep = (torch.cumsum(probs, dim=-1) - probs) < top_p
        values = values.masked_fill(~keep, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, values)
    return torch.softmax(x, dim=-1)


def _logprob(lp: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """``lp`` [V] fp32 log-probabilities -> the entry of ``token`` with the top ``n``."""
    chosen = lp[token]
    rank = int((lp > chosen).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if n:
        values, ids = torch.topk(lp, min(n, lp.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(chosen), rank, top)


def sample(logits: torch.Tensor, rows: Sequence[SequenceState]) -> list[tuple[int, TokenLogprob | None]]:
    """One token per row of ``logits`` [B, V] (rows[b] describes row b), with its logprobs where asked.

    Does not advance the rows: call ``rows[b].accept(token)`` once the token is kept."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits: expected [B={len(rows)}, V], got {tuple(logits.shape)}")
    raw = logits.float()  # [B, V]; a no-op (no copy) when the model already gives fp32
    want_lp = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
    logp = torch.log_softmax(raw[want_lp], dim=-1) if want_lp else None  # [L, V]
    processed = raw
    if any(r.processes for r in rows):
        processed = raw.clone()
        for b, r in enumerate(rows):
            if r.processes:
                r.process(processed[b])
    tokens = [0] * len(rows)
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    for b, r in enumerate(rows):
        if r.params.greedy:
            tokens[b] = int(torch.argmax(processed[b]))
    if sampled:
        probs = _filter(processed[sampled], [rows[b] for b in sampled])  # [S, V]
        for i, b in enumerate(sampled):
            q = torch.empty_like(probs[i]).exponential_(generator=rows[b].generator)  # [V]
            q.clamp_(min=torch.finfo(q.dtype).tiny)  # a draw of exactly 0 would make 0 / 0 = NaN, which argmax picks
            tokens[b] = int(torch.argmax(probs[i] / q))
    out: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in tokens]
    for i, b in enumerate(want_lp):
        out[b] = (tokens[b], _logprob(logp[i], tokens[b], rows[b].params.logprobs))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], n: int) -> list[TokenLogprob | None]:
    """Logprobs of each prompt token given the ones before it, from the prefill's ``logits`` [T, V] (position t
    predicts token t + 1). The first token has no context: None."""
    ids = torch.tensor(list(prompt), dtype=torch.long, device=logits.device)  # [T]
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(prompt) - 1, PROMPT_LOGPROB_CHUNK):
        stop = min(start + PROMPT_LOGPROB_CHUNK, len(prompt) - 1)
        lp = torch.log_softmax(logits[start:stop].float(), dim=-1)  # [C, V]
        nxt = ids[start + 1:stop + 1]  # [C]: the token each position predicts
        chosen = lp.gather(1, nxt.unsqueeze(1))  # [C, 1]
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        tops = torch.topk(lp, min(n, lp.shape[-1])) if n else None
        for i in range(stop - start):
            top = tuple(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else ()
            out.append(TokenLogprob(int(nxt[i]), float(chosen[i, 0]), int(ranks[i]), top))
    return out
