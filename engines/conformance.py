"""Conformance checks for an engine process (docs/engine-protocol.md).

    moe-offload engine-check -- ENGINE-COMMAND [ARGS...]

Each check returns a detail string or raises ``AssertionError``; ``run_checks``
runs them all against one started EngineProcess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moe_offload.engines.params import SamplingParams
from moe_offload.engines.process import EngineProcess
from moe_offload.errors import ConfigError

STATS_KEYS = {"prompt_tokens", "completion_tokens", "finish_reason", "prefill_ms", "decode_ms", "hits", "misses", "hit_rate_by_tier", "bytes_moved"}


def _prompt(engine: EngineProcess) -> list[int]:
    return [i % engine.info.vocab_size for i in (11, 12, 13, 14)]


def check_health(engine: EngineProcess) -> str:
    info = engine.info
    assert info.vocab_size > 0 and info.max_model_len > 0, "health must report vocab_size and max_model_len"
    assert engine.tiers, "health must report at least one memory tier"
    return f"model={info.model} vocab={info.vocab_size} tiers={[t.name for t in engine.tiers]}"


def check_greedy_deterministic(engine: EngineProcess) -> str:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a = list(engine.generate(_prompt(engine), params))
    b = list(engine.generate(_prompt(engine), params))
    assert a == b, f"greedy decoding differs between runs: {a} vs {b}"
    assert len(a) == 6, f"expected 6 tokens with ignore_eos, got {len(a)}"
    return f"tokens={a}"


def check_stats(engine: EngineProcess) -> str:
    gen = engine.generate(_prompt(engine), SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = list(gen)
    s = gen.stats.to_dict()
    missing = STATS_KEYS - set(s)
    assert not missing, f"done.stats lacks {sorted(missing)}"
    assert s["completion_tokens"] == len(tokens), "completion_tokens must count the streamed tokens"
    assert s["finish_reason"] == "length"
    return f"hit_rate={s['hit_rate']} prefill_ms={s['prefill_ms']}"


def check_bad_request(engine: EngineProcess) -> str:
    # Bypass the client-side check: the engine itself must answer an error event, not die.
    rid = "conformance-bad"
    engine._send({"op": "generate", "id": rid, "prompt_ids": [engine.info.vocab_size + 5], "params": {"max_tokens": 2}})
    while True:
        event = engine._next_event(30)
        if event.get("id") == rid:
            break
    assert event.get("event") == "error", f"expected an error event for an out-of-vocabulary id, got {event}"
    assert engine.alive, "the engine process died of a bad request"
    return event["error"]["message"][:60]


def check_cancel(engine: EngineProcess) -> str:
    gen = engine.generate(_prompt(engine), SamplingParams(max_tokens=engine.info.max_model_len - 8, ignore_eos=True))
    next(gen)
    gen.close()
    after = list(engine.generate(_prompt(engine), SamplingParams(max_tokens=2, ignore_eos=True)))
    assert len(after) == 2, "a request after a cancel must run normally"
    return "cancel honoured"


def check_client_errors(engine: EngineProcess) -> str:
    try:
        engine.generate([], SamplingParams())
    except ConfigError as e:
        return str(e)[:60]
    raise AssertionError("an empty prompt must be refused")


CHECKS: list[tuple[str, Callable[[EngineProcess], str]]] = [
    ("health", check_health),
    ("greedy is deterministic", check_greedy_deterministic),
    ("done carries stats", check_stats),
    ("bad request is an error event", check_bad_request),
    ("cancel", check_cancel),
    ("client-side validation", check_client_errors),
]


def run_checks(argv: Sequence[str], echo: Callable[[str], None] = print) -> int:
    """Start the engine, run every check, print one line each; returns the number of failures."""
    engine = EngineProcess(argv, start_timeout=300)
    failed = 0
    try:
        for name, check in CHECKS:
            try:
                echo(f"PASS {name}: {check(engine)}")
            except Exception as e:  # noqa: BLE001 - each failure is one line of the report
                failed += 1
                echo(f"FAIL {name}: {type(e).__name__}: {e}")
    finally:
        engine.close()
    return failed
