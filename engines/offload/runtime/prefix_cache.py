"""Automatic prefix caching: full KV blocks found again by the tokens they hold.

    a full block of sequence tokens t[i*bs : (i+1)*bs] --hash(parent block's hash, tokens)--> block hash
      (the chain's root: the engine's seed (model, KV dtype) and the request's cache_salt)
    commit (after a step computed a block's rows): hash -> block id, BlockStored event
    admit (a waiting sequence): the longest chain of its full prompt blocks found -> shared by reference, its
      computed tokens start after them (never the last prompt token: the step must give its logits)
    free (a sequence ends or is preempted): a block whose references reach 0 stays cached, evictable
      least-recently-used; allocate takes never-cached free blocks first, then evicts (BlockRemoved event)

Only whole blocks are shared and a sequence writes only rows after its computed ones, so a shared block is
never written (a sequence that diverges inside a block computes that block itself: no copy on write). A
block's hash covers the tokens that produced its rows and every token before them, so two sequences that
share a block hash share every KV row of it.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


def root_hash(seed: str, salt: str | None = None) -> bytes:
    """The chain's root: what changes every row besides the tokens (the model and KV dtype, as ``seed``; a
    request's ``cache_salt``, so that tenants who salt differently never share blocks)."""
    return hashlib.sha256(f"{seed}\0{salt or ''}".encode()).digest()


def block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def external(h: bytes) -> int:
    """The 64-bit signed integer a KV event carries for a block hash (vLLM's events carry ints)."""
    return int.from_bytes(h[:8], "big", signed=True)


@dataclass
class CacheEvent:
    """One KV event in vLLM's terms: kind "BlockStored" | "BlockRemoved" | "AllBlocksCleared"."""

    kind: str
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    tokens: list[int] = field(default_factory=list)


class PrefixCache:
    """Block hash <-> block id for a KVPool, its evictable blocks (reference count 0) in LRU order, counters and
    the KV events since the last ``drain_events``. The pool owns reference counts and the free list."""

    def __init__(self, block_size: int, seed: str, *, events: bool = False):
        self.block_size, self.seed = block_size, seed
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.queries = self.hits = 0  # prompt tokens asked for / found (vllm:prefix_cache_queries / _hits)
        self.record_events = events
        self.events: list[CacheEvent] = []

    def chain(self, tokens, upto: int, salt: str | None, have: list[bytes]) -> list[bytes]:
        """``have`` extended to the hashes of every full block within ``tokens[:upto]`` (``have`` is the chain of
        the same tokens computed before: only the new blocks are hashed)."""
        bs = self.block_size
        parent = have[-1] if have else root_hash(self.seed, salt)
        for i in range(len(have), upto // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            have.append(parent)
        return have

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` that is cached."""
        found = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def store(self, block: int, h: bytes, parent: bytes | None, tokens) -> None:
        """``block`` now holds the rows of hash ``h``; a hash already cached (two sequences computed the same block
        at once) keeps its first block, and this one stays uncached."""
        if h in self.by_hash or block in self.hash_of:
            return
        self.by_hash[h], self.hash_of[block] = block, h
        if self.record_events:
            self.events.append(CacheEvent("BlockStored", [external(h)], external(parent) if parent else None,
                                          list(tokens)))

    def forget(self, block: int) -> None:
        """``block`` is reused for other rows: it leaves the cache."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.by_hash[h]
            if self.record_events:
                self.events.append(CacheEvent("BlockRemoved", [external(h)]))

    def clear(self) -> None:
        self.by_hash.clear()
        self.hash_of.clear()
        self.evictable.clear()
        if self.record_events:
            self.events.append(CacheEvent("AllBlocksCleared"))

    def drain_events(self) -> tuple[float, list[CacheEvent]]:
        events, self.events = self.events, []
        return time.time(), events
