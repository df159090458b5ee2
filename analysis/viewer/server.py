"""The viewer's local web server: stdlib ``http.server`` on 127.0.0.1, read-only JSON.

Why the standard library: the page needs a handful of JSON routes and three static
files; a framework (Flask, FastAPI + uvicorn) would add dependencies and a second
process model for no feature we use. ``ThreadingHTTPServer`` serves each request on its
own thread; ``ViewerData`` serialises its DuckDB connection.

Safety:

* the socket binds ``127.0.0.1`` only (``HOST``; never ``0.0.0.0``);
* every request's ``Host`` header must name that address or ``localhost`` with the
  server's port, so a web page elsewhere cannot reach the server through DNS rebinding;
* reads go through the locked-down connection (``ViewerData``); tree filters through
  ``data.checked_where``;
* the only write (``POST /api/label``: append a label; off with ``labels=False``,
  ``rtrees view --no-labels``) must carry the page's random
  per-server token in an ``X-Rtrees-Token`` header: a cross-site form cannot set a
  header, and a cross-site script setting one needs a CORS preflight we never answer;
* static files come from a fixed list (no path from the request touches the disk), and
  the page builds every text node with ``textContent`` (stored text is never HTML).

Routes: ``/`` (the page), ``/static/<file>``, ``/api/summary``, ``/api/runs``,
``/api/trees?where=&run=``, ``/api/tree?id=``, ``/api/compare?tree=&a=&b=``,
``/api/metrics?run=``. An error is ``{"error": "..."}`` with status 400 (bad input) or
404 (unknown tree or route).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from analysis.viewer.data import FilterError, ViewerData
from rollout_store.store import Store, StoreError

HOST = "127.0.0.1"  # never 0.0.0.0: the viewer is for this machine only
STATIC_FILES = {"viewer.js": "text/javascript", "viewer.css": "text/css"}
TOKEN_HEADER = "X-Rtrees-Token"


def static_text(name: str) -> str:
    """A file of ``analysis/viewer/static`` (package data)."""
    return resources.files("analysis.viewer").joinpath("static", name).read_text("utf-8")


def page_html(token: str = "", static_data: str | None = None, inline: bool = False) -> str:
    """The page: ``index.html`` with the write token, and for a static export the data
    (``static_data``: a JSON object of API path -> answer) and, with ``inline``, the
    script and stylesheet inlined."""
    html = static_text("index.html").replace("{{TOKEN}}", token)
    # Every "<" of the JSON (only ever inside its strings) as \u003c: no stored text can
    # close the script element or open a comment in it.
    data = "" if static_data is None else (
        "<script>window.RTREES_STATIC = " + static_data.replace("<", "\\u003c")
        + ";</script>")
    html = html.replace("{{STATIC_DATA}}", data)
    if inline:
        html = html.replace('<link rel="stylesheet" href="static/viewer.css">',
                            "<style>" + static_text("viewer.css") + "</style>")
        html = html.replace('<script src="static/viewer.js"></script>',
                            "<script>" + static_text("viewer.js").replace("</", "<\\/")
                            + "</script>")
    return html


def answer(data: ViewerData, path: str, query: dict[str, list[str]]) -> Any:
    """The JSON answer of one API route (``KeyError``: unknown tree/method/route;
    ``ValueError``: bad input). Shared by the server and the static export."""
    def arg(name: str, required: bool = True) -> str:
        values = query.get(name)
        if not values or not values[0]:
            if required:
                raise ValueError(f"missing query parameter {name!r}")
            return ""
        return values[0]

    if path == "/api/summary":
        return data.summary()
    if path == "/api/runs":
        return data.runs()
    if path == "/api/trees":
        return data.trees(arg("where", False) or None, arg("run", False) or None)
    if path == "/api/tree":
        return data.tree(arg("id"))
    if path == "/api/compare":
        return data.compare(arg("tree"), arg("a"), arg("b"))
    if path == "/api/metrics":
        return data.metrics(arg("run"))
    if path == "/api/labels":
        return data.labels(arg("tree"))
    raise KeyError(f"no route {path}")


class ViewerServer(ThreadingHTTPServer):
    """The HTTP server with its ``ViewerData`` and write token."""

    daemon_threads = True

    def __init__(self, data: ViewerData, port: int = 0,
                 on_label: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        super().__init__((HOST, port), ViewerHandler)
        self.data = data
        self.token = secrets.token_urlsafe(24)
        self.on_label = on_label

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"


class ViewerHandler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the CLI prints the URL, not one line per request

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").lower()
        return host in (f"{HOST}:{self.server.port}", f"localhost:{self.server.port}")

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; connect-src 'self'")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, default=str).encode(), "application/json")

    def do_GET(self) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.FORBIDDEN, {"error": "bad Host header"})
            return
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            token = self.server.token if self.server.on_label else ""  # no token: no form
            self._send(HTTPStatus.OK, page_html(token).encode(), "text/html; charset=utf-8")
            return
        if url.path.startswith("/static/"):
            name = url.path[len("/static/"):]
            if name in STATIC_FILES:
                self._send(HTTPStatus.OK, static_text(name).encode(),
                           STATIC_FILES[name] + "; charset=utf-8")
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no file {name!r}"})
            return
        try:
            result = answer(self.server.data, url.path, parse_qs(url.query))
        except FilterError as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        except KeyError as exc:
            self._json(HTTPStatus.NOT_FOUND, {"error": str(exc.args[0]) if exc.args else ""})
        except ValueError as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        else:
            self._json(HTTPStatus.OK, result)

    def do_POST(self) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.FORBIDDEN, {"error": "bad Host header"})
            return
        if not secrets.compare_digest(self.headers.get(TOKEN_HEADER, ""), self.server.token):
            self._json(HTTPStatus.FORBIDDEN, {"error": f"missing or wrong {TOKEN_HEADER}"})
            return
        if urlsplit(self.path).path != "/api/label" or self.server.on_label is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": "no such route"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= 65_536:
                raise ValueError("a label request is 1 byte to 64 KiB of JSON")
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("a label request is a JSON object")
            result = self.server.on_label(body)
        except (ValueError, KeyError, StoreError) as exc:  # TreeValidationError: ValueError
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        else:
            self._json(HTTPStatus.OK, result)


def label_writer(data: ViewerData) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ``POST /api/label`` action: ``{"tree_id", "node_id" (or null), "key", "value"
    (null clears), "author" (optional)}`` appended with ``rollout_store.labels``; the view
    is re-pinned so the page reads it back; answers the tree's labels."""
    from rollout_store.labels import write_labels

    def write(body: dict[str, Any]) -> dict[str, Any]:
        tree_id, node_id, key = body.get("tree_id"), body.get("node_id"), body.get("key")
        value, author = body.get("value"), body.get("author") or None
        if not isinstance(tree_id, str) or not isinstance(key, str):
            raise ValueError("a label needs tree_id and key (strings)")
        if node_id is not None and (not isinstance(node_id, int) or isinstance(node_id, bool)):
            raise ValueError("node_id must be an integer or null")
        if value is not None and not isinstance(value, str):
            raise ValueError("value must be a string or null")
        if author is not None and not isinstance(author, str):
            raise ValueError("author must be a string")
        write_labels(data.store, tree_id, node_id, {key: value}, author)
        data.reload()
        return data.labels(tree_id)

    return write


def start(store: Store | str | Path, port: int = 0, labels: bool = True
          ) -> tuple[ViewerServer, threading.Thread]:
    """Serve ``store`` on ``127.0.0.1:port`` (0: a free port) from a background thread;
    stop with ``server.shutdown()``. ``labels``: the page may append labels."""
    data = ViewerData(store)
    server = ViewerServer(data, port, label_writer(data) if labels else None)
    thread = threading.Thread(target=server.serve_forever, name="rtrees-view", daemon=True)
    thread.start()
    return server, thread


def serve(store: Store | str | Path, port: int = 0,
          on_ready: Callable[[str], None] | None = None, labels: bool = True) -> None:
    """Serve ``store`` until interrupted; ``on_ready(url)`` once the socket listens."""
    data = ViewerData(store)
    server = ViewerServer(data, port, label_writer(data) if labels else None)
    if on_ready is not None:
        on_ready(server.url)
    try:
        server.serve_forever()
    finally:
        server.server_close()
