"""Run an ASGI app with uvicorn: in a background thread (tests, ai-rm) or in the foreground (CLI).

The socket is bound here, before uvicorn starts, so a port in use is a clear
ConfigError instead of a log line from a thread, and ``port=0`` picks a free port.

In the foreground a SIGTERM drains (what Kubernetes sends before it stops a pod):

    SIGTERM --> drain.drain(): readiness (/ready) fails, new requests get 503 "draining" + Retry-After
            --> the requests in flight finish (up to ``drain_timeout`` s; then drain.give_up(): each ends with a 503
                error event, a stream with its error chunk and [DONE])
            --> uvicorn stops, exit status 0.    A second SIGTERM: stop now (exit by the signal); Ctrl-C:
                uvicorn's own shutdown.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from moe_offload.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port: expected an integer in 0..65535, got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use: expected a free port (or --port 0 for any free one)") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # Linux hands TCP_NODELAY on to accepted sockets: without it, a response written in two pieces
    # (headers, body; or SSE chunks) waits ~40 ms for the client's delayed ACK (Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _config(app, log_level: str):
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=3,
                          timeout_keep_alive=30)


@dataclass
class ServerHandle:
    """A server running in a background thread. ``url`` is where it listens; ``stop()`` shuts it down."""

    url: str
    port: int
    server: object
    thread: threading.Thread
    sock: socket.socket = field(repr=False)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", timeout: float = 30.0) -> ServerHandle:
    """Serve ``app`` on host:port in a daemon thread; returns once it accepts connections. Raises ConfigError if the port is taken."""
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(_config(app, log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{sock.getsockname()[1]}", daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise ConfigError(f"the server on {url_of(sock)} failed to start (see the log above)")
        if time.monotonic() - t0 > timeout:
            server.should_exit = True
            raise ConfigError(f"the server on {url_of(sock)} did not start within {timeout:.0f} s")
        time.sleep(0.01)
    return ServerHandle(url_of(sock), sock.getsockname()[1], server, thread, sock)


DRAIN_TIMEOUT = 30.0  # seconds a SIGTERM leaves the requests in flight (Kubernetes' default grace period)


def run_server(app, sock: socket.socket, *, log_level: str = "info", drain=None,
               drain_timeout: float = DRAIN_TIMEOUT) -> None:
    """Serve in the foreground on an already bound socket (the CLI: Ctrl-C stops it). ``drain``: what a SIGTERM
    drains (an object with drain(), idle and give_up(): the worker's EngineRunner), else SIGTERM stops at once. An
    EngineRunner that gives up on its engine (``fatal``: a crash loop) stops the server, and the process exits 1."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            if drain is not None and sig == signal.SIGTERM and self.draining:
                self.force_exit = True  # a second SIGTERM: stop now (the process then ends by the signal)
            if drain is None or sig != signal.SIGTERM or self.draining:
                return super().handle_exit(sig, frame)
            # not recorded as a captured signal: uvicorn would raise it again at exit (the process dying of it)
            self.draining = True
            drain.drain()
            threading.Thread(target=self.finish, name="drain", daemon=True).start()

        def finish(self) -> None:
            end = time.monotonic() + drain_timeout
            while not drain.idle and time.monotonic() < end:
                time.sleep(0.05)
            if not drain.idle:
                drain.give_up()
                end = time.monotonic() + 2.0  # the error events reach their streams
                while not drain.idle and time.monotonic() < end:
                    time.sleep(0.05)
            if not drain.idle:  # the engine thread did not come back (a hung step): the errors go from here
                drain.abandon_now()
                time.sleep(0.5)
            self.should_exit = True

    server = Server(_config(app, log_level))
    if drain is not None and hasattr(drain, "on_fatal"):
        drain.on_fatal = lambda: setattr(server, "should_exit", True)  # the engine cannot be rebuilt: stop serving
    server.run(sockets=[sock])
    if getattr(drain, "fatal", None):
        raise SystemExit(f"moe-offload worker: {drain.fatal}")  # non-zero: the orchestrator restarts the process
