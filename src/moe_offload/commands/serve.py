"""`moe-offload worker | serve | gateway`: the OpenAI-compatible worker and the expert-affinity gateway."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import click

from moe_offload.commands.options import (
    COLD_DTYPE_CHOICE,
    COLD_DTYPE_HELP,
    DENSE_DTYPE_CHOICE,
    DEVICES_HELP,
    EXPERT_DTYPE_CHOICE,
    KV_DTYPE_CHOICE,
    KV_DTYPE_HELP,
    SPECULATIVE_HELP,
    TAIL_SKIP_HELP,
    TENSOR_PARALLEL_HELP,
    ranks_share_cores,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _worker_options(fn):
    opts = [
        click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told otherwise)."),
        click.option("--port", default=8000, show_default=True, type=int, help="Port to bind (0: any free port)."),
        click.option("--placement", type=click.Path(exists=True, dir_okay=False), help="rm-core Placement JSON."),
        click.option("--policy", help="Miss policy for cpu/cuda: static | lru | hybrid."),
        click.option("--fraction", type=float, help="Resident fraction of each layer's experts (cpu/cuda, without --placement)."),
        click.option("--expert-dtype", type=EXPERT_DTYPE_CHOICE,
                     help="cpu/cuda: experts in memory as int8/fp8 (quantized at load) or bf16 (default: as stored)."),
        click.option("--dense-dtype", type=DENSE_DTYPE_CHOICE,
                     help="cpu: dense linears (attention, shared experts, dense MLPs) and LM head as int8 rows too (bf16 compute; default: as loaded)."),
        click.option("--mock-ms-per-token", type=float, default=5.0, show_default=True, help="mock backend: decode time per token."),
        click.option("--mock-hit-rate", type=float, default=0.85, show_default=True, help="mock backend: simulated hit rate."),
        click.option("--engine", "engine_bin", help="rngd backend: the external engine binary (JSON-lines protocol)."),
        click.option("--engine-data", help="rngd backend: the external engine's input directory."),
        click.option("--served-model-name", help="Model name clients send (default: the model directory's name)."),
        click.option("--api-key", envvar="MOE_OFFLOAD_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* [env MOE_OFFLOAD_API_KEY]."),
        click.option("--max-queue", default=64, show_default=True, type=int, help="Waiting requests beyond which new ones get 429."),
        click.option("--max-num-seqs", type=int, help="cpu/cuda: sequences decoded together in one step [default: 16]."),
        click.option("--max-num-batched-tokens", type=int, help="cpu/cuda: tokens per step (decode + prefill chunks) [default: 512]."),
        click.option("--kv-cache-memory", help="cpu/cuda: KV cache budget, e.g. 2GiB [default: cpu: what the weights leave in the memory limit, at most 4GiB; cuda: 80%% of free memory]."),
        click.option("--host-memory", help="cpu/cuda: host memory for routed experts, e.g. 8GiB; those that do not fit "
                     "live on disk [default: what the process's memory limit leaves]."),
        click.option("--max-model-len", type=int, help="cpu/cuda: longest prompt + output served [default: the model's, capped to the KV budget]."),
        click.option("--block-size", type=int, help="cpu/cuda: tokens per KV block [default: 16]."),
        click.option("--speculative-config", "speculative", help="cpu/cuda: " + SPECULATIVE_HELP
                     + " A request turns it off with \"speculative\": false."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
                     help="cpu/cuda: keep full KV blocks for later requests that share a prefix (a conversation's "
                          "earlier turns, an agent's system prompt); a request salts its own with \"cache_salt\"."),
        click.option("--kv-cache-dtype", type=KV_DTYPE_CHOICE, default="auto", show_default=True,
                     help="cpu/cuda: " + KV_DTYPE_HELP),
        click.option("--kv-events-config", help="cpu/cuda: publish prefix cache events as vLLM does, for llm-d's "
                     "prefix-aware routing: JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                     "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'."),
        click.option("--tail-skip", type=int, metavar="RANK", help="cpu/cuda: " + TAIL_SKIP_HELP),
        click.option("--cold-dtype", type=COLD_DTYPE_CHOICE, help="cpu/cuda: " + COLD_DTYPE_HELP),
        click.option("--devices", help="cpu/cuda: " + DEVICES_HELP),
        click.option("--tensor-parallel", type=click.IntRange(min=1), metavar="N", help="cpu: " + TENSOR_PARALLEL_HELP),
        click.option("--request-timeout", default=600.0, show_default=True, type=float, help="Seconds from arrival to the last token (504 after)."),
        click.option("--max-body-bytes", default=4 * 1024 * 1024, show_default=True, type=int, help="Larger request bodies get 413."),
        click.option("--trust-request-chat-template", is_flag=True,
                     help="Render a request's own chat_template (a template is a program the worker runs; off: 400)."),
        click.option("--hang-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                     help="Seconds one engine step may run before /health answers 503 (a hung engine or rank); "
                          "rngd: an engine process silent this long during a generation is killed (503, restarted)."),
        click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
                     help="On SIGTERM: seconds the requests in flight get to finish (new ones get 503, /ready fails); "
                          "those still running then end with an error, and the worker exits 0."),
        click.option("--gateway", "gateway_url", help="Register with this gateway (needs --gateway-token)."),
        click.option("--gateway-token", envvar="MOE_OFFLOAD_GATEWAY_TOKEN", help="The gateway's shared token [env MOE_OFFLOAD_GATEWAY_TOKEN]."),
        click.option("--advertise-url", help="URL the gateway should use for this worker (default: http://HOST:PORT)."),
        click.option("--generation-config", default="auto", show_default=True,
                     help="Default sampling values: auto (the model's generation_config.json), vllm (none), or a directory."),
        click.option("--tool-call-parser", default="auto", show_default=True, type=click.Choice(["auto", "hermes", "qwen3_coder"]),
                     help="How tool calls are read from replies (auto: from the chat template)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _run_worker(backend_name: str, model: str | None, *, host, port, placement, policy, fraction, expert_dtype, dense_dtype,
                mock_ms_per_token,
                mock_hit_rate, engine_bin, engine_data, served_model_name, api_key, max_queue, request_timeout, max_body_bytes, gateway_url,
                gateway_token, advertise_url, banner: bool, max_num_seqs=None, max_num_batched_tokens=None, kv_cache_memory=None, host_memory=None,
                max_model_len=None, block_size=None, generation_config: str = "auto", tool_call_parser: str = "auto",
                speculative=None, tail_skip=None, cold_dtype=None, devices=None, tensor_parallel=None,
                drain_timeout: float = 30.0, hang_timeout: float = 60.0,
                trust_request_chat_template: bool = False, enable_prefix_caching: bool = True,
                kv_events_config: str | None = None, kv_cache_dtype: str = "auto") -> None:
    ranks_share_cores(tensor_parallel)  # before anything imports torch
    from moe_offload import backends
    from moe_offload.errors import ConfigError
    from moe_offload.serving import server, worker

    if gateway_url and not gateway_token:
        raise ConfigError("--gateway needs --gateway-token (or $MOE_OFFLOAD_GATEWAY_TOKEN): the gateway refuses unauthenticated workers")
    from moe_offload.serving.kv_events import KVEventsConfig

    kv_events = KVEventsConfig.parse(kv_events_config)  # checked before the model loads
    backend = backends.get_backend(backend_name)
    backend.require()
    placement_obj = None
    if placement:
        from rm_core import Placement

        placement_obj = Placement.from_json(Path(placement).read_text())
    from moe_offload.control.units import parse_size

    options = backends.engine_options(backend_name, policy=policy, fraction=fraction, expert_dtype=expert_dtype,
                                      dense_dtype=dense_dtype, mock_ms=mock_ms_per_token,
                                      mock_hit=mock_hit_rate, engine=engine_bin, data=engine_data, watchdog=hang_timeout,
                                      max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                      block_size=block_size, speculative=_speculative(speculative), tail_skip=tail_skip,
                                      cold_dtype=cold_dtype, devices=devices or None, tensor_parallel=tensor_parallel,
                                      enable_prefix_caching=enable_prefix_caching, kv_events=kv_events is not None or None,
                                      kv_cache_dtype=kv_cache_dtype if kv_cache_dtype != "auto" else None,
                                      kv_cache_memory=parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None,
                                      host_memory=parse_size(host_memory, "--host-memory") if host_memory else None)
    sock = server.bind(host, port)  # before loading the model: a taken port fails fast
    url = server.url_of(sock)
    name = served_model_name or (Path(model).name if model else ("mock" if backend_name == "mock" else "moe-offload-demo"))
    what = model or ("the mock engine" if backend_name == "mock" else "the demo model")
    click.echo(f"loading {what} on backend {backend_name} ...", err=True)
    app = worker.create_app(lambda: backend.build_engine(model, placement_obj, **options), model_name=name, api_key=api_key or None,
                            max_queue=max_queue, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
                            placement=placement_obj, tiers=backend.tiers(), generation_config=generation_config,
                            tool_parser=tool_call_parser, hang_timeout=hang_timeout,
                            trust_request_chat_template=trust_request_chat_template, kv_events=kv_events)
    if host not in LOOPBACK and not api_key:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)
    if gateway_url:
        from moe_offload.serving.gateway import register

        me = advertise_url or url
        threading.Thread(target=_register, args=(register, gateway_url, gateway_token, me, name), daemon=True).start()
    if banner:
        auth = ' -H "Authorization: Bearer $MOE_OFFLOAD_API_KEY"' if api_key else ""
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
        click.echo(f"moe-offload worker: {name} ({backend_name}) at {url}  (OpenAI API under {url}/v1, metrics at {url}/metrics)")
        click.echo(f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    server.run_server(app, sock, drain=app.state.worker.runner, drain_timeout=drain_timeout)


def _speculative(text: str | None):
    """--speculative-config, checked before the model loads (None: off)."""
    if not text:
        return None
    from moe_offload.engines.params import SpeculativeConfig

    return SpeculativeConfig.parse(text)


def _register(register, gateway_url, token, me, name) -> None:
    from moe_offload.log import get_logger

    try:
        ok = register(gateway_url, token, me, model=name)
        get_logger("serving").info("registered with gateway" if ok else "gateway unreachable; not registered", gateway=gateway_url)
    except Exception as e:  # noqa: BLE001 - a refused registration must not stop the worker serving directly
        get_logger("serving").error("registration failed", gateway=gateway_url, error=str(e))


@click.command("worker")
@click.option("--backend", default="cpu", show_default=True, help="Backend: mock | cpu | cuda | rngd (see `moe-offload backends`).")
@click.option("--model", help="Checkpoint directory or GGUF file (default: the demo model).")
@_worker_options
def worker_cmd(backend, model, **kw) -> None:
    """Serve one model over an OpenAI-compatible API (vLLM-style /metrics)."""
    _run_worker(backend, model, banner=True, **kw)


def _default_backend() -> str:
    """cpu when the offload engine can load here (torch + transformers), else mock."""
    import importlib.util

    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return "cpu"
    return "mock"


@click.command("serve")
@click.option("--backend", default=None, help="cpu (default when torch is installed) or mock; cuda/rngd with --model.")
@click.option("--model", help="Checkpoint directory or GGUF file (default: the demo model, built on first use).")
@_worker_options
def serve_cmd(backend, model, **kw) -> None:
    """Serve the demo model (or --model) with sensible defaults; prints the URL and a curl line."""
    ranks_share_cores(kw.get("tensor_parallel"))  # before the demo model's build imports torch
    backend = backend or _default_backend()
    if backend != "mock" and not model:
        from moe_offload import demo

        click.echo("the demo model: trained on Python's standard library (small: plausible code, not correct code)"
                   if demo.trained_dir() else "preparing the demo model (random weights: its output is nonsense) ...",
                   err=True)
        model = str(demo.default_model())
        kw["served_model_name"] = kw.get("served_model_name") or "moe-offload-demo"
    _run_worker(backend, model, banner=True, **kw)


@click.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port to bind.")
@click.option("--worker", "workers", multiple=True, help="A worker's base URL (repeatable).")
@click.option("--token", envvar="MOE_OFFLOAD_GATEWAY_TOKEN", help="Shared token workers register with [env MOE_OFFLOAD_GATEWAY_TOKEN]; without it registration is refused.")
@click.option("--api-key", envvar="MOE_OFFLOAD_API_KEY", help="Require 'Authorization: Bearer KEY' from clients (passed on to workers).")
@click.option("--lambda", "lam", default=0.05, show_default=True, type=float, help="Load penalty per in-flight request (affinity units).")
@click.option("--prefix-weight", default=0.5, show_default=True, type=click.FloatRange(min=0),
              help="Bonus (affinity units) for the worker that was sent a request's whole prefix before: a "
                   "conversation or a shared system prompt stays where its KV blocks are cached (0: off).")
@click.option("--alpha", default=0.2, show_default=True, type=float, help="EWMA weight of each measured hit rate.")
@click.option("--health-interval", default=2.0, show_default=True, type=float, help="Seconds between worker /health probes.")
def gateway_cmd(host, port, workers, token, api_key, lam, prefix_weight, alpha, health_interval) -> None:
    """Route OpenAI requests to the worker whose resident experts fit them best."""
    from moe_offload.serving import gateway, server

    sock = server.bind(host, port)
    app = gateway.create_app(list(workers), token=token, api_key=api_key, lam=lam, alpha=alpha, health_interval=health_interval,
                             prefix_weight=prefix_weight)
    url = server.url_of(sock)
    click.echo(f"moe-offload gateway at {url}: {len(workers)} worker(s); registration {'open with the token' if token else 'disabled (no --token)'}")
    click.echo(f"workers and scores: curl {url}/gateway/workers")
    server.run_server(app, sock)


commands = [worker_cmd, serve_cmd, gateway_cmd]
