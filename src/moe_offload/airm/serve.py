"""``run(Workload(kind="serve"), **config)``: the worker (or gateway) for ai-rm.

    config --build engine (tiers logged)--> worker app --start_server(host, port)--> [metrics_port server]
           --register with the gateway (if any)--> block until SIGTERM, or return a handle (block=False)

Every failure before the server is up raises ContractError and leaves nothing running.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from moe_offload import settings
from rm_core import ContractError, Workload

GATEWAY_TOKEN_ENV = "MOE_OFFLOAD_GATEWAY_TOKEN"


@dataclass
class RunningWorkload:
    """What ``serve(block=False)`` returns: where it listens, and how to stop it."""

    url: str
    role: str
    metrics_url: str | None = None
    _stops: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def stop(self) -> None:
        while self._stops:
            self._stops.pop()()


def _power_collector(backend: str):
    """A prometheus collector for airm_power_w{scope="card"}; yields nothing where power cannot be read."""
    from prometheus_client.core import GaugeMetricFamily

    from moe_offload.airm.power import card_power_w

    class PowerCollector:
        def collect(self):
            watts = card_power_w(backend)
            if not watts:
                return
            g = GaugeMetricFamily("airm_power_w", "Accelerator card power draw, watts.", labels=["scope", "card"])
            for card, w in sorted(watts.items()):
                g.add_metric(["card", card], w)
            yield g

    return PowerCollector()


def _metrics_app(registry):
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from prometheus_client import generate_latest

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _start(app, host: str, port: int):
    from moe_offload.errors import OffloadError
    from moe_offload.serving.server import start_server

    try:
        return start_server(app, host, port)
    except OffloadError as e:
        raise ContractError("config.port", f"a free port on {host}", str(e)) from None


def _worker(cfg, log, running: RunningWorkload) -> None:
    from moe_offload.airm.build import build
    from moe_offload.serving import worker

    backend, engine, tiers, model = build(cfg, log, serving=True)
    first = [engine]

    def factory():
        # The engine built (and validated) up front serves first; a crashed engine is rebuilt from the config.
        return first.pop() if first else build(cfg, log, serving=True)[1]

    name = os.path.basename(model.rstrip("/")) or model
    try:
        app = worker.create_app(factory, model_name=name, api_key=cfg.api_key, tiers=tiers, predicted_by_class=cfg.priors or None)
    except Exception:
        engine.close()
        raise
    registry = app.state.worker.metrics.registry
    registry.register(_power_collector(backend.name))
    try:
        handle = _start(app, cfg.host, cfg.port)
    except ContractError:
        app.state.worker.runner.close()  # the app never started, so its shutdown will not close the engine
        raise
    running.url = handle.url
    running._stops.append(handle.stop)
    if cfg.metrics_port is not None:
        mh = _start(_metrics_app(registry), cfg.host, cfg.metrics_port)
        running.metrics_url = f"{mh.url}/metrics"
        running._stops.append(mh.stop)
    if cfg.gateway:
        _register(cfg, handle.url, name, log)
    log.info("serving", role="worker", url=handle.url, model=name, backend=backend.name, wid=cfg.wid)


def _register(cfg, url: str, name: str, log) -> None:
    from moe_offload.serving.gateway import register

    token = settings.get(GATEWAY_TOKEN_ENV) or ""
    if not token:
        raise ContractError("config.gateway", f"${GATEWAY_TOKEN_ENV} set (the gateway refuses workers without its token)", cfg.gateway)

    def go():
        try:
            ok = register(cfg.gateway, token, url, model=name, predicted=cfg.priors or None)
            log.info("gateway_registered" if ok else "gateway_unreachable", gateway=cfg.gateway)
        except Exception as e:  # noqa: BLE001 - a refused registration must not stop the worker serving directly
            log.error("gateway_registration_failed", gateway=cfg.gateway, error=str(e))

    threading.Thread(target=go, name="gateway-register", daemon=True).start()


def _gateway(cfg, log, running: RunningWorkload) -> None:
    from moe_offload.serving import gateway

    app = gateway.create_app((), token=settings.get(GATEWAY_TOKEN_ENV) or None, api_key=cfg.api_key)
    handle = _start(app, cfg.host, cfg.port)
    running.url = handle.url
    running._stops.append(handle.stop)
    log.info("serving", role="gateway", url=handle.url)


def serve(workload: Workload, cfg) -> RunningWorkload | None:
    from moe_offload import log as logmod

    if cfg.log:
        logmod.configure(level=cfg.log)
    log = logmod.get_logger("moe_offload.airm")
    if workload.model and not cfg.model:
        cfg = type(cfg)(**{**cfg.__dict__, "model": workload.model})
    running = RunningWorkload(url="", role=cfg.role)
    try:
        (_gateway if cfg.role == "gateway" else _worker)(cfg, log, running)
    except BaseException:
        running.stop()
        raise
    if not cfg.block:
        return running
    _wait_for_signal(log)
    running.stop()
    return None


def _wait_for_signal(log) -> None:
    done = threading.Event()

    def handler(signum, _frame):
        log.info("stopping", signal=signal.Signals(signum).name)
        done.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        done.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


__all__: list[Any] = ["RunningWorkload", "serve"]
