"""The expert-affinity gateway: routes each OpenAI request to the worker whose resident experts fit it best.

    request --classify (script x code/prose)--> WorkerPool.rank(class): affinity - lam x load
        --httpx proxy (streaming too)--> worker --headers / SSE comment: measured hit rate--> EWMA

Statuses pass through. A worker that cannot be reached (or answers 502/503)
is skipped for the next one; a non-streaming request whose worker dies
mid-way is retried on the next worker, so it is not lost. After
``fail_threshold`` failures in a row a worker is unhealthy until its /ready
answers 200 again (readiness: a draining worker fails it at once, so no new request is sent there). Workers are given on the command line or register
themselves at ``POST /gateway/register`` with the shared token (without a
configured token, registration is refused: anyone could otherwise register a
worker and receive users' prompts). No torch here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moe_offload import __version__
from moe_offload.log import get_logger
from moe_offload.serving import errors, prefix_index
from moe_offload.serving.classify import CLASSES, classify, request_text
from moe_offload.serving.errors import APIError
from moe_offload.serving.http import CLASS_HEADER, DEFAULT_MAX_BODY, HIT_HEADER, check_api_key, read_body
from moe_offload.serving.pool import WorkerEntry, WorkerPool
from moe_offload.serving.prefix_index import prefix_text
from moe_offload.serving.protocol import parse_json

log = get_logger("serving.gateway")
TOKEN_ENV = "MOE_OFFLOAD_GATEWAY_TOKEN"
WORKER_HEADER = "x-moe-offload-worker"
_STREAM_STATS = re.compile(rb": x-moe-offload-hit-rate=([0-9.]+) class=([a-z-]+)")
# Hop-by-hop and length headers are the proxy's own business.
_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}


# A worker's 503 codes not tried on another worker: the engine failed while running the request (which may have caused
# it: a request of death would take every worker's engine down in turn). Draining, restarting or a full queue are
# retried elsewhere.
NOT_RETRIED = frozenset({"engine_failed"})


def _error_code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
        return err.get("code") if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return None

class _Metrics:
    def __init__(self, pool: WorkerPool):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("moe_offload_gateway_requests", "Requests proxied, by worker, class and outcome.",
                                ["worker", "class", "outcome"], registry=r)
        self.retries = Counter("moe_offload_gateway_retries", "Attempts moved to the next worker after a failure.", ["worker"], registry=r)
        self.latency = Histogram("moe_offload_gateway_request_seconds", "Time from request to the worker's last byte.", ["class"], registry=r,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.healthy = Gauge("moe_offload_gateway_worker_healthy", "1 if the worker is routable.", ["worker"], registry=r)
        self.inflight = Gauge("moe_offload_gateway_worker_inflight", "Requests in flight at the worker via this gateway.", ["worker"], registry=r)
        self.affinity = Gauge("moe_offload_gateway_affinity", "EWMA of measured hit rate per worker and class (seeded: predicted).",
                              ["worker", "class"], registry=r)
        self.pool = pool

    def render(self) -> bytes:
        for w in self.pool.workers.values():
            self.healthy.labels(worker=w.url).set(1 if w.healthy else 0)
            self.inflight.labels(worker=w.url).set(w.inflight)
            for c in CLASSES:
                self.affinity.labels(worker=w.url, **{"class": c}).set(w.affinity(c))
        return generate_latest(self.registry)


def _check_url(url) -> str:
    p = urlparse(url) if isinstance(url, str) else None
    if not p or p.scheme not in ("http", "https") or not p.netloc:
        raise APIError(400, f"url: expected an http(s) URL of a worker, got {url!r}", param="url")
    return url.rstrip("/")


class Gateway:
    def __init__(self, pool: WorkerPool, *, token: str | None, api_key: str | None, health_interval: float,
                 connect_timeout: float, request_timeout: float, max_body_bytes: int):
        self.pool, self.token, self.api_key = pool, token, api_key
        self.health_interval, self.max_body_bytes = health_interval, max_body_bytes
        self.timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self.metrics = _Metrics(pool)
        self.client: httpx.AsyncClient | None = None

    async def refresh(self, w: WorkerEntry) -> None:
        """Probe /ready; on 200, (re)read /affinity for seeds if none yet."""
        try:
            r = await self.client.get(w.url + "/ready", timeout=2.0)
            ok = r.status_code == 200
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = f"/ready answered {r.status_code}"
        if ok:
            if not w.healthy:
                log.info("worker healthy again", worker=w.url)
            self.pool.succeeded(w)
            if not w.seed:
                try:
                    auth = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                    r = await self.client.get(w.url + "/affinity", timeout=2.0, headers=auth)
                    if r.status_code != 200:  # 401: the worker's --api-key is not the gateway's
                        raise ValueError(f"/affinity answered {r.status_code}")
                    a = r.json()
                    seed = {"all": a.get("predicted"), **{c: v.get("affinity") for c, v in a["classes"].items()}}
                    w.seed = {k: float(v) for k, v in seed.items() if v is not None}
                    w.model = w.model or a.get("model")
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    log.warning("worker has no usable /affinity", worker=w.url, error=str(e))
        else:
            was = w.healthy
            self.pool.failed(w, why)
            if was and not w.healthy:
                log.warning("worker marked unhealthy", worker=w.url, error=why)

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(w) for w in list(self.pool.workers.values())), return_exceptions=True)
            await asyncio.sleep(self.health_interval)

    def _headers(self, request: Request) -> dict:
        h = {"content-type": request.headers.get("content-type", "application/json")}
        if "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        return h

    @staticmethod
    def _passthrough(headers: httpx.Headers, w: WorkerEntry | None = None) -> dict:
        out = {k: v for k, v in headers.items() if k.lower() not in _DROP}
        if w is not None:
            out[WORKER_HEADER] = w.url  # which worker answered: for clients' logs and the tests
        return out

    def _feedback(self, w: WorkerEntry, cls: str, headers: httpx.Headers | None = None, tail: bytes = b"") -> None:
        rate, wcls = None, cls
        if headers is not None and HIT_HEADER in headers:
            rate, wcls = headers[HIT_HEADER], headers.get(CLASS_HEADER, cls)
        elif tail:
            m = _STREAM_STATS.search(tail)
            if m:
                rate, wcls = m.group(1).decode(), m.group(2).decode()
        if rate is not None:
            try:
                self.pool.feedback(w, wcls if wcls in CLASSES else cls, float(rate))
            except ValueError:
                pass

    async def proxy(self, request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        if self.api_key:
            check_api_key(request, self.api_key)
        raw = await read_body(request, self.max_body_bytes)
        try:
            body = parse_json(raw)
        except APIError:
            body = None  # the worker answers with the proper 400
        cls = classify(request_text(body))
        chunks = prefix_index.chain(prefix_text(body), body.get("model") if isinstance(body, dict) else None)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = self._headers(request)
        last_error = "no workers are registered"
        for w in self.pool.rank(cls, chunks):
            w.inflight += 1
            released = False
            try:
                req = self.client.build_request("POST", w.url + path, content=raw, headers=headers)
                resp = await self.client.send(req, stream=True)
                if resp.status_code in (502, 503):
                    content = await resp.aread()
                    await resp.aclose()
                    last_error = f"{w.url} answered {resp.status_code}"
                    self.pool.failed(w, last_error)
                    if _error_code(content) in NOT_RETRIED:  # this request crashed that engine: it would crash the next
                        self._count(w, cls, resp.status_code, t0)
                        return Response(content, status_code=resp.status_code,
                                        headers=self._passthrough(resp.headers, w))
                    self.metrics.retries.labels(worker=w.url).inc()
                    continue
                if resp.status_code == 200 and chunks:
                    self.pool.prefixes.record(w.url, chunks)  # its prefix cache now holds them
                if not stream or resp.status_code != 200:
                    content = await resp.aread()
                    await resp.aclose()
                    self.pool.succeeded(w)
                    self._feedback(w, cls, resp.headers)
                    self._count(w, cls, resp.status_code, t0)
                    return Response(content, status_code=resp.status_code, headers=self._passthrough(resp.headers, w))
                self.pool.succeeded(w)
                released = True  # the stream releases the worker when it ends
                return StreamingResponse(self._relay(w, cls, resp, t0), status_code=resp.status_code,
                                         headers=self._passthrough(resp.headers, w))
            except httpx.TransportError as e:
                # Unreachable, or died before answering in full: nothing reached the client yet, so retry elsewhere.
                last_error = f"{w.url}: {type(e).__name__}: {e}"
                self.pool.failed(w, last_error)
                self.metrics.retries.labels(worker=w.url).inc()
            finally:
                if not released:
                    w.inflight -= 1
        self.metrics.requests.labels(worker="none", outcome="unavailable", **{"class": cls}).inc()
        raise APIError(503, f"no worker could serve the request (last error: {last_error})", code="no_worker_available")

    def _count(self, w: WorkerEntry, cls: str, status: int, t0: float) -> None:
        w.routed[cls] = w.routed.get(cls, 0) + 1
        self.metrics.requests.labels(worker=w.url, outcome=str(status), **{"class": cls}).inc()
        self.metrics.latency.labels(**{"class": cls}).observe(time.perf_counter() - t0)

    async def _relay(self, w: WorkerEntry, cls: str, resp: httpx.Response, t0: float):
        tail = b""
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-512:]
                yield chunk
            self._feedback(w, cls, tail=tail)
            self._count(w, cls, resp.status_code, t0)
        except httpx.TransportError as e:
            # Mid-stream: the client already has part of the answer, so report the failure in-band instead of retrying.
            self.pool.failed(w, f"{type(e).__name__}: {e}")
            err = APIError(502, f"the worker failed mid-stream: {type(e).__name__}", code="worker_failed")
            yield ("data: " + json.dumps(err.body()) + "\n\ndata: [DONE]\n\n").encode()
        finally:
            w.inflight -= 1
            await resp.aclose()


def create_app(workers: Sequence[str] = (), *, token: str | None = None, api_key: str | None = None, lam: float = 0.05,
               alpha: float = 0.2, fail_threshold: int = 3, health_interval: float = 2.0, connect_timeout: float = 2.0,
               request_timeout: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY, seed: int | None = None,
               prefix_weight: float = 0.5) -> FastAPI:
    """The gateway's FastAPI app. ``workers``: worker base URLs known from the start. ``token``: the shared secret
    workers register with (None: registration refused). ``api_key``: required from clients on /v1/* (also passed
    on to workers). ``lam``: load penalty per in-flight request, in affinity units (fraction 0..1). ``alpha``: EWMA
    weight of each new measurement. ``health_interval``: seconds between /health probes. ``seed``: tie-break RNG seed.
    ``prefix_weight``: score bonus, in affinity units, of a worker that was sent the request's whole prefix before
    (its share of the prefix's chunks, prefix_index.py); 0 routes by affinity and load alone.
    """
    import random

    from moe_offload.errors import ConfigError

    if not health_interval > 0:
        raise ConfigError(f"health_interval: expected seconds > 0 (0 probes the workers in a busy loop), got {health_interval}")
    if not request_timeout > 0 or not connect_timeout > 0:
        raise ConfigError(f"timeouts: expected seconds > 0, got request {request_timeout}, connect {connect_timeout}")
    if max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes: expected >= 1, got {max_body_bytes}")
    pool = WorkerPool(lam=lam, alpha=alpha, fail_threshold=fail_threshold, rng=random.Random(seed),
                      prefix_weight=prefix_weight)
    for url in workers:
        pool.add(_check_url_cli(url))
    gw = Gateway(pool, token=token or None, api_key=api_key or None, health_interval=health_interval,
                 connect_timeout=connect_timeout, request_timeout=request_timeout, max_body_bytes=max_body_bytes)

    @asynccontextmanager
    async def lifespan(_app):
        gw.client = httpx.AsyncClient(timeout=gw.timeout, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
        await asyncio.gather(*(gw.refresh(w) for w in list(pool.workers.values())), return_exceptions=True)
        task = asyncio.create_task(gw.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await gw.client.aclose()

    app = FastAPI(title="moe-offload gateway", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    errors.install(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await gw.proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await gw.proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, gw.api_key)
        for w in pool.rank("latin-prose"):
            try:
                r = await gw.client.get(w.url + "/v1/models", headers=gw._headers(request))
                return Response(r.content, status_code=r.status_code, headers=gw._passthrough(r.headers))
            except httpx.TransportError:
                continue
        raise APIError(503, "no worker is reachable", code="no_worker_available")

    @app.post("/gateway/register")
    async def register(request: Request):
        if not gw.token:
            raise APIError(403, "registration is disabled: start the gateway with --token (or $MOE_OFFLOAD_GATEWAY_TOKEN)")
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {gw.token}".encode()):
            raise APIError(401, "registration needs the gateway's shared token as 'Authorization: Bearer <token>'", code="invalid_token")
        body = parse_json(await read_body(request, gw.max_body_bytes))
        url = _check_url(body.get("url"))
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise APIError(400, f"model: expected a string, got {body['model']!r}"[:300], param="model")
        predicted = body.get("predicted") or {}
        if not isinstance(predicted, dict) or not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in predicted.values()):
            raise APIError(400, "predicted: expected {class: fraction 0..1}", param="predicted")
        w = pool.add(url, model=body.get("model"), seed=predicted or None, registered=True)
        await gw.refresh(w)
        log.info("worker registered", worker=url, healthy=w.healthy)
        return {"registered": url, "healthy": w.healthy}

    @app.post("/gateway/deregister")
    async def deregister(request: Request):
        if not gw.token or not hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {gw.token}".encode()):
            raise APIError(401, "deregistration needs the gateway's shared token", code="invalid_token")
        body = parse_json(await read_body(request, gw.max_body_bytes))
        url = _check_url(body.get("url"))
        return {"removed": pool.remove(url)}

    @app.get("/gateway/workers")
    async def workers_view(request: Request):
        check_api_key(request, gw.api_key)  # the workers' addresses and routing statistics
        return {"lambda": pool.lam, "alpha": pool.alpha, "classes": list(CLASSES), "workers": pool.describe()}

    @app.get("/health")
    async def health():
        if any(w.healthy for w in pool.workers.values()):
            return Response(status_code=200)
        return APIError(503, "no healthy worker", code="no_worker_available").response()

    @app.get("/version")
    async def version():
        return {"version": __version__, "role": "gateway"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _check_url_cli(url: str) -> str:
    from moe_offload.errors import ConfigError

    try:
        return _check_url(url)
    except APIError as e:
        raise ConfigError(e.message) from None


def register(gateway_url: str, token: str, worker_url: str, *, model: str | None = None, predicted: dict | None = None,
             attempts: int = 30, delay: float = 1.0) -> bool:
    """Register a worker at a gateway (blocking; retries while the gateway is not up). Returns True on success.
    A refusal (401/403/400) is raised as ConfigError: retrying would not help."""
    from moe_offload.errors import ConfigError

    body = {"url": worker_url, "model": model, "predicted": predicted or {}}
    for i in range(attempts):
        try:
            r = httpx.post(gateway_url.rstrip("/") + "/gateway/register", json=body, headers={"authorization": f"Bearer {token}"}, timeout=5)
        except httpx.HTTPError as e:
            log.info("gateway not reachable yet", gateway=gateway_url, attempt=i + 1, error=str(e))
            time.sleep(delay)
            continue
        if r.status_code == 200:
            return True
        if r.status_code in (400, 401, 403):
            raise ConfigError(f"the gateway refused the registration ({r.status_code}): {r.text[:300]}")
        time.sleep(delay)
    return False
