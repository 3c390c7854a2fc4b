"""Serve any in-process engine over the JSON-lines engine protocol (docs/engine-protocol.md).

    python -m moe_offload.engines.stdio --backend mock [--model PATH] [--option key=value ...]
                                        [--devices cpu,cpu] [--placement FILE]

This is the reference engine process: the conformance check runs against it,
and it runs an in-process engine isolated from the worker.
Requests are read one per line from stdin; events are written one per line to stdout.
A cancel is honoured between tokens (a reader thread watches stdin while a request runs).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from typing import Any

from moe_offload.engines.params import SamplingParams
from moe_offload.errors import OffloadError
from rm_core import ContractError

PROTOCOL = "moe-offload-engine/1"


def _write(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _params(raw: Any) -> SamplingParams:
    if not isinstance(raw, dict):
        raise OffloadError(f"params: expected an object, got {raw!r}")
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise OffloadError(f"params.{unknown[0]}: unknown; expected one of {', '.join(sorted(known))}")
    raw = dict(raw)
    if "stop_token_ids" in raw:
        raw["stop_token_ids"] = tuple(raw["stop_token_ids"])
    return SamplingParams(**raw)


class Server:
    def __init__(self, engine, tiers):
        self.engine = engine
        self.tiers = tiers
        self.requests: queue.Queue = queue.Queue()
        self.cancelled: set[str] = set()

    def health(self, rid) -> dict[str, Any]:
        info = self.engine.info
        tok = self.engine.tokenizer
        return {
            "id": rid,
            "event": "health",
            "ok": True,
            "protocol": PROTOCOL,
            "model": info.model,
            "backend": info.backend,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "eos_token_ids": list(info.eos_token_ids),
            "policy": info.policy,
            "predicted_hit_rate": dict(info.predicted_hit_rate),
            "features": sorted(info.features),
            "tokenizer": "byte" if type(tok).__name__ == "ByteTokenizer" else "hf",
            "tiers": [t.to_dict() for t in self.tiers],
        }

    def read_stdin(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ValueError("a request is a JSON object")
            except ValueError as e:
                _write({"id": None, "event": "error", "error": {"type": "invalid_request_error", "message": f"bad request line: {e}"}})
                continue
            if req.get("op") == "cancel":
                self.cancelled.add(str(req.get("id")))
            else:
                self.requests.put(req)
        self.requests.put({"op": "shutdown"})

    def generate(self, rid, req) -> None:
        params = _params(req.get("params", {}))
        prompt = req.get("prompt_ids")
        if not isinstance(prompt, list):
            raise OffloadError(f"prompt_ids: expected a list of token ids, got {prompt!r}")
        gen = self.engine.generate(prompt, params)
        for token in gen:
            if rid in self.cancelled:
                gen.close()
                break
            _write({"id": rid, "event": "token", "token": token})
        self.cancelled.discard(rid)
        _write({"id": rid, "event": "done", "stats": gen.stats.to_dict()})

    def serve(self) -> None:
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while True:
            req = self.requests.get()
            op, rid = req.get("op"), req.get("id")
            try:
                if op == "shutdown":
                    return
                if op == "health":
                    _write(self.health(rid))
                elif op == "stats":
                    _write({"id": rid, "event": "stats", "stats": self.engine.stats()})
                elif op == "generate":
                    self.generate(rid, req)
                else:
                    raise OffloadError(f"op: expected health | generate | cancel | stats | shutdown, got {op!r}")
            except (OffloadError, ContractError) as e:
                kind = getattr(e, "type", "invalid_request_error")
                _write({"id": rid, "event": "error", "error": {"type": kind, "message": str(e)}})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_offload.engines.stdio", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mock")
    ap.add_argument("--model", default=None)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="engine option (JSON value or string)")
    ap.add_argument("--devices", help="several accelerators, e.g. cpu,cpu (each a tier of its own)")
    ap.add_argument("--placement", help="an rm_core Placement JSON file")
    args = ap.parse_args(argv)
    from moe_offload.backends import get_backend

    options: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    if args.devices:
        options["devices"] = args.devices
    try:
        backend = get_backend(args.backend)
        engine = backend.build_engine(args.model, args.placement, **options)
        tiers = backend.tiers()
        if args.devices:
            from moe_offload.control.devices import device_tiers, parse

            tiers = device_tiers(parse(args.devices), tiers)
    except (OffloadError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        Server(engine, tiers).serve()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
