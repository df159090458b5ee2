"""A loopback HTTP server for chat completions: the transport of the agent programs'
endpoint and of ``rtrees serve``.

Security (a ``127.0.0.1`` port is reachable by every local account, not only its owner):

* it binds ``127.0.0.1`` only;
* the ``Host`` header must name that address or ``localhost`` with the server's port
  (a web page in a browser cannot reach it by DNS rebinding);
* every request needs ``Authorization: Bearer KEY`` with the endpoint's key (compared in
  constant time; ``secrets.token_urlsafe`` keys, generated per server or per session);
* bodies are bounded (``Limits.max_body_bytes``) and checked (``train.envs.agent.wire``);
  every refusal is a one-line JSON error with HTTP 400 (401 for a missing or wrong key,
  404 for an unknown path); an unexpected failure is a one-line 500, never a traceback;
* nothing a request holds is executed: it is parsed as JSON and read as data.

Routing: ``route(path, key)`` (given by the owner) maps a request path and its bearer key
to an ``Endpoint`` (None: 404 or 401). An endpoint answers ``complete(request)`` with a
``chat.completion`` body (``stream``: sent as server-sent events).
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from train.envs.agent.wire import (
    LIMITS,
    ChatRequest,
    Limits,
    WireError,
    error_body,
    parse_body,
    parse_request,
    stream_events,
)

CHAT_PATH = "/chat/completions"
MODELS_PATH = "/models"


class Unauthorized(Exception):
    """A request without the endpoint's key."""


class Endpoint(Protocol):
    """What serves the chat completions of one route."""

    @property
    def models(self) -> tuple[str, ...] | None:
        """Model names accepted (None: any)."""
        ...

    def complete(self, request: ChatRequest) -> dict[str, Any]:
        """The ``chat.completion`` body answering ``request`` (``WireError``: a 400)."""
        ...


Route = Callable[[str, str], Endpoint]
"""``route(base_path, bearer_key) -> Endpoint``; raises ``KeyError`` for an unknown path,
``Unauthorized`` for a wrong key."""


def same_key(given: str, expected: str) -> bool:
    """Constant-time comparison of two keys."""
    return hmac.compare_digest(given.encode("utf-8", "replace"),
                               expected.encode("utf-8", "replace"))


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "rtrees"
    sys_version = ""
    protocol_version = "HTTP/1.1"  # keep-alive: a client's calls reuse one connection
    disable_nagle_algorithm = True  # headers and body are two writes: without this, the
    # client's delayed ACK held every response ~40 ms (measured: 45 ms per call, now ~1)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the owner's terminal is not a request log."""

    def _send(self, code: int, body: bytes, content_type: str = "application/json",
              close: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        # an unread body must not become the next request: the connection closes, and the
        # client is told so (a pooled client would otherwise reuse a dead connection)
        self.close_connection = True
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            code, "invalid_request_error" if code < 500 else "server_error")
        self._send(code, error_body(message, kind), close=True)

    def _endpoint(self, suffix: str) -> Endpoint | None:
        host = self.headers.get("Host", "")
        port = self.server.server_address[1]
        if host not in (f"127.0.0.1:{port}", f"localhost:{port}"):
            self._error(400, f"Host header {host[:80]!r} is not this server")
            return None
        path = self.path.split("?", 1)[0]
        if not path.endswith(suffix):
            self._error(404, f"no such path {path[:80]!r}")
            return None
        auth = self.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else ""
        try:
            return self.server.route(path[:-len(suffix)], key)
        except KeyError:
            self._error(404, f"no such path {path[:80]!r}")
        except Unauthorized:
            self._error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return None

    def do_GET(self) -> None:
        endpoint = self._endpoint(MODELS_PATH)
        if endpoint is None:
            return
        names = endpoint.models or ("default",)
        self._send(200, json.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "rtrees"}
            for m in names]}).encode())

    def do_POST(self) -> None:
        endpoint = self._endpoint(CHAT_PATH)
        if endpoint is None:
            return
        limits = self.server.limits
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(400, "Content-Length is required")
            return
        if length < 0 or length > limits.max_body_bytes:
            self._error(400, f"request body is over {limits.max_body_bytes} bytes")
            return
        try:
            request = parse_request(parse_body(self.rfile.read(length), limits),
                                    endpoint.models, limits)
            body = endpoint.complete(request)
        except WireError as exc:
            self._error(exc.status, str(exc).splitlines()[0] if str(exc) else "bad request")
            return
        except Exception as exc:  # never a traceback on the wire
            self._error(500, f"internal error: {type(exc).__name__}")
            return
        if not request.stream:
            self._send(200, json.dumps(body).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in stream_events(request, body):
            self.wfile.write(chunk)
        self.wfile.flush()
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False
    request_queue_size = 256  # listen backlog: socketserver's 5 reset concurrent sessions

    def __init__(self, route: Route, limits: Limits, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.route = route
        self.limits = limits


class LoopbackServer:
    """A chat-completions server on ``127.0.0.1`` (module docstring), serving in a daemon
    thread from construction until ``close``. ``port`` 0 picks a free one."""

    def __init__(self, route: Route, *, port: int = 0, limits: Limits = LIMITS) -> None:
        self._server = _Server(route, limits, port)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="rtrees-chat-http", daemon=True)
        self._thread.start()

    def url(self, base_path: str = "") -> str:
        """``http://127.0.0.1:PORT`` + ``base_path``."""
        return f"http://127.0.0.1:{self.port}{base_path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["CHAT_PATH", "Endpoint", "LoopbackServer", "Route", "Unauthorized", "same_key"]
