"""KV events in vLLM's format, for prefix-aware routers (llm-d's prefix-cache scorer, Dynamo's KV router).

    engine step --PrefixCache events (BlockStored / BlockRemoved / AllBlocksCleared)--> EngineRunner.after_step
      --KVEventPublisher.publish(ts, events)--> queue --publisher thread--> ZMQ PUB
      multipart (topic, sequence number: 8 bytes big-endian, msgpack EventBatch)
    replay (optional ROUTER socket): a subscriber sends the first sequence number it missed (8 bytes big-endian);
      it gets back each buffered (sequence, payload) from there, then (-1, b"")

The payload is what vLLM's msgspec structs encode (array_like, tagged): EventBatch = [ts, [event, ...],
data_parallel_rank]; BlockStored = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]; BlockRemoved = ["BlockRemoved", block_hashes, medium]; AllBlocksCleared = ["AllBlocksCleared"].
Block hashes are 64-bit signed integers (the first 8 bytes of the engine's sha256 chain).
"""

from __future__ import annotations

import json
import queue
import threading
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgpack

from moe_offload.errors import ConfigError
from moe_offload.log import get_logger

log = get_logger("serving.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "CPU"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config, as JSON."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> "KVEventsConfig | None":
        """The config from JSON text; None when absent or not enabled."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config: not JSON ({e.msg} at {e.pos})") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown key(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(known))}")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher: expected zmq or null, got {cfg.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--kv-events-config: {name}: expected an integer >= 1, got {v!r}")
        if not isinstance(cfg.endpoint, str) or "://" not in cfg.endpoint:
            raise ConfigError(f"--kv-events-config: endpoint: expected a ZMQ address like tcp://*:5557, got {cfg.endpoint!r}")
        return cfg if cfg.enable_kv_cache_events and cfg.publisher == "zmq" else None


def encode(ts: float, events, block_size: int, dp_rank: int | None = None) -> bytes:
    """One EventBatch (prefix_cache.CacheEvent list) as vLLM's subscribers decode it."""
    out: list[Any] = []
    for e in events:
        if e.kind == "BlockStored":
            out.append(["BlockStored", e.hashes, e.parent, e.tokens, block_size, None, MEDIUM])
        elif e.kind == "BlockRemoved":
            out.append(["BlockRemoved", e.hashes, MEDIUM])
        else:
            out.append(["AllBlocksCleared"])
    return msgpack.packb([ts, out, dp_rank] if dp_rank is not None else [ts, out])


class KVEventPublisher:
    """vLLM's ZMQ publisher: a PUB socket (bound when the endpoint has a wildcard or is ipc/inproc, else connected),
    an optional ROUTER for replays, and a thread that sends what ``publish`` queues, so the engine never waits on a
    socket. A full queue drops the batch and logs it (subscribers see the gap in the sequence numbers and replay)."""

    def __init__(self, config: KVEventsConfig, block_size: int):
        import zmq

        self.config, self.block_size = config, block_size
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        ep = config.endpoint
        try:
            if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                self._pub.bind(ep)
            else:
                self._pub.connect(ep)
            self._replay = None
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            raise ConfigError(f"--kv-events-config: cannot open {ep}: {e}") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._running = True
        self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="moe-offload-kv-events", daemon=True)
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            log.warning("KV event batch dropped: the publisher's queue is full", dropped=self.dropped)

    def after_step(self, engine) -> None:
        """The EngineRunner's hook: the step's events, if any, as one batch."""
        drain = getattr(engine, "drain_kv_events", None)
        if drain is None:
            return
        ts, events = drain()
        if events:
            self.publish(encode(ts, events, self.block_size))

    def _loop(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception as e:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.warning("KV event replay failed", error=str(e))
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            seq = next(self._seq)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception as e:  # noqa: BLE001 - logged; the batch stays in the replay buffer
                log.warning("KV event batch not sent", seq=seq, error=str(e))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
