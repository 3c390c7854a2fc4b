"""The gateway keeps a shared prefix on one worker (its prefix cache holds the blocks), and still spreads the rest."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from moe_offload.serving import gateway
from moe_offload.serving.pool import WorkerPool
from moe_offload.serving.prefix_index import CHUNK, chain, prefix_text

SYSTEM = "You are the support agent of a parts catalogue; answer from the catalogue only. " * 12  # > 3 chunks


def _chat(question: str, system: str = SYSTEM) -> dict:
    return {"model": "mock", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


@pytest.mark.parametrize("weight", [0.5, 0.0])
def test_a_shared_system_prompt_stays_on_one_worker(mock_worker, serve, weight):
    workers = [mock_worker(hit_rate=0.8).url for _ in range(3)]
    gw = serve(gateway.create_app(workers, seed=3, prefix_weight=weight, health_interval=30))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        where = Counter(c.post("/v1/chat/completions", json=_chat(f"question {i}?")).headers[gateway.WORKER_HEADER]
                        for i in range(12))
        # prompts without a long shared prefix: spread as before (affinity, load, random ties)
        spread = Counter(c.post("/v1/chat/completions", json=_chat(f"question {i}?", system=f"{i}")).headers[
            gateway.WORKER_HEADER] for i in range(12))
        view = c.get("/gateway/workers").json()["workers"]
    if weight:
        assert len(where) == 1, where  # every turn after the first goes where the prefix went
        assert sum(w["prefix_chunks"] > 0 for w in view) >= 1
    else:
        assert len(where) > 1, where  # without the prefix term the same traffic spreads
    assert len(spread) > 1, spread


def test_the_prefix_term_counts_leading_chunks_only():
    pool = WorkerPool(prefix_weight=0.5)
    a, b = pool.add("http://a"), pool.add("http://b")
    text = prefix_text(_chat("q"))
    chunks = chain(text, "m")
    assert len(chunks) == len(text) // CHUNK >= 3
    pool.prefixes.record(a.url, chunks[:2])
    pool.prefixes.record(b.url, chunks[1:])  # not the first chunk: nothing leads
    assert pool.prefixes.matched(a.url, chunks) == 2 and pool.prefixes.matched(b.url, chunks) == 0
    assert pool.score(a, "latin-prose", chunks) - pool.score(b, "latin-prose", chunks) == pytest.approx(0.5 * 2 / len(chunks))
    assert chain(text, "another model") != chunks and chain(text[:-1] + "x", "m")[:len(chunks) - 1] == chunks[:-1]
    pool.remove(a.url)
    assert pool.prefixes.matched(a.url, chunks) == 0
