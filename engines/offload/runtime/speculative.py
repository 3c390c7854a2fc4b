"""Speculative decoding: draft k tokens cheaply, verify them in one step of the target model, keep what it agrees with.

    running sequence, its last token not yet computed --Proposer.propose(tokens, k)--> draft d1..dk (Sequence.draft)
      --the scheduler: 1 + k tokens of the sequence in the step (last token, d1..dk)-->
      the model runner: one forward (the fused decode path takes the k + 1 tokens as rows of one step, the module
      path as a chunk) --> logits rows r0..rk (ri: the distribution after d1..di)
      --verify(rows, draft, state)--> tokens e1..ej, j = accepted + 1: greedy keeps di while it is ri-1's argmax,
        then ri's argmax (the correction, or the bonus after all k); sampled: rejection sampling
      the KV rows of rejected drafts are left behind the sequence's length (overwritten by the next step)

Proposers: prompt lookup (``ngram``: the longest recent n-gram match in the sequence's own tokens, as vLLM's
``ngram`` method) and a draft model (``draft_model``: a small causal LM with the same tokenizer, greedy, its own
cache per sequence). Both draft one token per position (a point mass), so rejection sampling (Leviathan et al. 2023,
as vLLM's rejection sampler) accepts draft x with probability p(x) and on rejection draws from p without x: the output
has the target distribution whatever the draft. Greedy output is the plain run's token for token.

Not speculated (they decode one token a step as before): a request that asked for logit processing that depends on
the tokens before it (structured output, penalties, logit_bias, min_tokens still pending) or prompt logprobs, a
request with ``speculative`` off, and models whose layers keep recurrent state (linear attention, Mamba: a rejected
draft would have to be rolled out of their state); the engine refuses a speculative config for those at start.
"""

from __future__ import annotations

import torch

from moe_offload.engines.base import TokenLogprob
from moe_offload.engines.params import SpeculativeConfig
from moe_offload.errors import ConfigError


class NgramProposer:
    """Prompt lookup: the longest n-gram (prompt_lookup_max down to _min) ending the sequence that occurred before;
    the tokens that followed its latest earlier occurrence are the draft."""

    def __init__(self, config: SpeculativeConfig):
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, sid: int, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if k < 1 or L < self.lo + 1:
            return []
        t = torch.tensor(tokens, dtype=torch.int64)
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            windows = t[: L - 1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a token after it
            hit = (windows == t[L - n :]).all(dim=1).nonzero()
            if hit.numel():
                start = int(hit[-1]) + n  # the latest occurrence
                return tokens[start : start + k]
        return []

    def release(self, sid: int) -> None:
        pass


class DraftModelProposer:
    """A small causal LM (same tokenizer) drafting greedily on its own per-sequence cache: each call feeds the tokens
    the draft has not seen (its cache cut back to what still matches the sequence), then drafts k tokens."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int):
        from transformers import AutoModelForCausalLM

        from moe_offload.engines.offload.loading.inspection import check_checkpoint

        path = check_checkpoint(config.model)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        v = int(self.model.config.get_text_config().vocab_size)
        if v > vocab_size:
            raise ConfigError(f"draft model {config.model}: vocabulary of {v} tokens, larger than the target's "
                              f"{vocab_size}: the two must share a tokenizer")
        self.seqs: dict[int, tuple[object, list[int]]] = {}  # sid -> (its cache, the tokens in it)

    @torch.inference_mode()
    def propose(self, sid: int, tokens: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        cache, seen = self.seqs.get(sid, (None, []))
        keep = 0
        for a, b in zip(seen, tokens[:-1]):  # the last token is always fed: its logits give the first draft
            if a != b:
                break
            keep += 1
        if cache is not None and keep < len(seen):
            cache.crop(keep)
        new, out = tokens[keep:], []
        for _ in range(k):
            res = self.model(input_ids=torch.tensor([new]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            new = [nxt]
        # the cache holds tokens + every draft but the last; keep them as seen (the next call cuts what was rejected)
        self.seqs[sid] = (cache, list(tokens) + out[:-1])
        return out

    def release(self, sid: int) -> None:
        self.seqs.pop(sid, None)


def make_proposer(config: SpeculativeConfig, vocab_size: int):
    return NgramProposer(config) if config.method == "ngram" else DraftModelProposer(config, vocab_size)


def speculates(state) -> bool:
    """Whether this step may draft for a sequence (``state``: its SequenceState): asked for, and no processing of the
    logits that depends on the tokens before each one (grammar, penalties, logit_bias, min_tokens still pending)."""
    p = state.params
    return p.speculative and p.prompt_logprobs is None and not state.processes


def verify(rows: torch.Tensor, draft: list[int], state) -> tuple[list[int], list[TokenLogprob | None]]:
    """The tokens a verify step keeps: ``rows`` [k + 1, V] the target's logits after the last token and after each
    draft token, ``draft`` [k], ``state`` the sequence's SequenceState (params, generator). Returns (tokens, logprobs):
    the accepted drafts then one more (the correction, or the bonus when all k were accepted)."""
    from moe_offload.engines.offload.runtime.sampling import _logprob

    p = state.params
    raw = rows.float()
    out: list[int] = []
    if p.greedy:
        best = raw.argmax(dim=-1).tolist()  # [k + 1]
        for i, d in enumerate(draft):
            out.append(best[i])
            if best[i] != d:
                break
        else:
            out.append(best[len(draft)])
    else:
        probs = _filter_probs(raw, state)  # [k + 1, V]: the distribution each token is drawn from
        gen = state.generator
        for i, d in enumerate(draft):
            u = torch.rand((), generator=gen, device=probs.device)
            if float(u) < float(probs[i, d]):  # accepted with probability p(d): the draft's q is 1 at d
                out.append(d)
                continue
            residual = probs[i].clone()
            residual[d] = 0.0  # max(p - q, 0), renormalised by the draw below
            out.append(_draw(residual, gen))
            break
        else:
            out.append(_draw(probs[len(draft)], gen))
    lps: list[TokenLogprob | None] = [None] * len(out)
    if p.logprobs is not None:
        logp = torch.log_softmax(raw[: len(out)], dim=-1)
        lps = [_logprob(logp[i], t, p.logprobs) for i, t in enumerate(out)]
    return out, lps


def _filter_probs(raw: torch.Tensor, state) -> torch.Tensor:
    """The distribution plain sampling draws each row of ``raw`` [R, V] fp32 from (temperature, min_p, top-k/p)."""
    from moe_offload.engines.offload.runtime.sampling import _filter

    return _filter(raw.float(), [state] * raw.shape[0])


def _draw(probs: torch.Tensor, gen) -> int:
    """One draw from ``probs`` [V] (unnormalised), as sampling.sample draws: the exponential race."""
    q = torch.empty_like(probs).exponential_(generator=gen)
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return int(torch.argmax(probs / q))
