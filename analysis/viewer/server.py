"""The viewer's local web server: stdlib ``http.server`` on 127.0.0.1, read-only JSON.

Why the standard library: the page needs a handful of JSON routes and three static
files; a framework (Flask, FastAPI + uvicorn) would add dependencies and a second
process model for no feature we use. ``ThreadingHTTPServer`` serves each request on its
own thread; ``ViewerData`` serialises its DuckDB connection.

Safety:

* the socket binds ``127.0.0.1`` only (``HOST``; never ``0.0.0.0``);
* the viewer is its owner's alone: 127.0.0.1 is open to every account of the machine,
  so every route (the page, static files, the API) needs the server's random access
  token (``ViewerServer.access_token``), as Jupyter's does. The owner gets it in the URL
  the CLI prints to stdout (``ViewerServer.login_url``: ``http://127.0.0.1:PORT/?token=``);
  a request carrying it in ``?token=`` is answered and sets an ``HttpOnly``,
  ``SameSite=Strict`` cookie (``rtrees-view-PORT``) the page's own requests then carry.
  Without the cookie or the token every route answers 403 (so another local user sees
  no tree, no text, no metric and never the page holding the label token). Secrets are
  compared with ``hmac.compare_digest``. For remote use, forward the port
  (``ssh -L PORT:127.0.0.1:PORT host``) and open the printed URL;
* every request's ``Host`` header must name that address or ``localhost`` with the
  server's port, so a web page elsewhere cannot reach the server through DNS rebinding;
* reads go through the locked-down connection (``ViewerData``); tree filters through
  ``data.checked_where``, and a filter that fails when run (a bad regex, a failed cast)
  is a 400 like one the checker refuses;
* the only write (``POST /api/label``: append a label; off with ``labels=False``,
  ``rtrees view --no-labels``) needs the access token too and must carry the page's
  random per-server label token in an ``X-Rtrees-Token`` header: a cross-site form
  cannot set a header, and a cross-site script setting one needs a CORS preflight we
  never answer. The label's author is the user the server runs as (``server_user``),
  never a field of the request (an ``author`` in the body is ignored);
* every answer is bounded: a label request is at most ``MAX_BODY`` bytes, a query string
  at most ``MAX_QUERY``, a tree list at most ``data.MAX_TREES`` rows, a client that stops
  sending is dropped after ``REQUEST_TIMEOUT`` seconds, and ``REQUEST_QUEUE`` pending
  connections wait in the listen backlog (the default 5 dropped some of 200 concurrent
  requests);
* any exception in a route is a one-line JSON answer (400 for bad input, 500 naming
  our own bug), never a dropped connection nor a traceback on stderr;
* static files come from a fixed list (no path from the request touches the disk), and
  the page builds every text node with ``textContent`` (stored text is never HTML).

Routes: ``/`` (the page), ``/static/<file>``, ``/api/summary``, ``/api/runs``,
``/api/trees?where=&run=``, ``/api/tree?id=``, ``/api/compare?tree=&a=&b=``,
``/api/metrics?run=``, ``/api/labels?tree=``, ``POST /api/label``, and for comparisons
(issue 48) ``/api/stores`` (the stores open), ``/api/siblings?tree=&node=&ref=`` (a
branching node's children side by side), ``/api/paths?paths=`` (trajectories in columns
by step; ``paths`` is a JSON list of ``[store, tree_id, leaf or null]``) and
``/api/metrics_diff?a=&b=&store_a=&store_b=`` (two runs' metrics overlaid, held-out
success with intervals). Every tree route takes ``store=`` (a name ``/api/stores`` lists;
default the first): the viewer can open several stores, each on its own locked, pinned
connection. An error is
``{"error": "..."}`` (one line) with status 400 (bad input), 403 (no access token, a
wrong Host or label token), 404 (unknown tree or route) or 500 (a bug of ours).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from analysis.viewer.data import ViewerData, ViewerStores
from rollout_store.store import Store, StoreError

HOST = "127.0.0.1"  # never 0.0.0.0: the viewer is for this machine only
STATIC_FILES = {"viewer.js": "text/javascript", "viewer.css": "text/css"}
TOKEN_HEADER = "X-Rtrees-Token"  # the label (write) token, read by the page's script
TOKEN_PARAM = "token"  # the access token in the URL the CLI prints
MAX_BODY = 65_536  # bytes of one label request
MAX_QUERY = 16_384  # bytes of one query string (a filter is a line, not a file)
REQUEST_TIMEOUT = 30.0  # seconds a client may take to send a request
REQUEST_QUEUE = 128  # listen backlog: connections waiting to be accepted
MAX_NODE_ID = 2**63 - 1  # node ids are int64 in the store (schema.py)
MAX_PATHS = 64  # trajectories one /api/paths compares


class RequestError(Exception):
    """A request answered with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def one_line(exc: BaseException | str) -> str:
    """The first line of an error's text (DuckDB's messages add the query below it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def same_secret(given: str, secret: str) -> bool:
    """``given == secret`` in constant time (``hmac.compare_digest`` on UTF-8 bytes: a
    str argument with non-ASCII characters would raise ``TypeError`` instead)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               secret.encode("utf-8"))


def server_user() -> str:
    """The name of the user this process runs as (``os.geteuid()``'s passwd entry), the
    author of every label written through the viewer."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError, AttributeError):  # no passwd entry, or not POSIX
        import getpass

        try:
            return getpass.getuser()
        except (KeyError, OSError):
            return f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "unknown"


def static_text(name: str) -> str:
    """A file of ``analysis/viewer/static`` (package data)."""
    return resources.files("analysis.viewer").joinpath("static", name).read_text("utf-8")


def page_html(token: str = "", static_data: str | None = None, inline: bool = False) -> str:
    """The page: ``index.html`` with the label token (the server's, only on a page served
    to its owner), and for a static export the data (``static_data``: a JSON object of
    API path -> answer) and, with ``inline``, the script and stylesheet inlined."""
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


def node_id(text: str, name: str = "node") -> int:
    """A node id from a request (``ValueError`` naming ``name`` unless 0..MAX_NODE_ID)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer node id, got {text!r}") from None
    if not 0 <= value <= MAX_NODE_ID:
        raise ValueError(f"{name} must be in 0..{MAX_NODE_ID}")
    return value


def path_specs(text: str) -> list[tuple[str | None, str, int | None]]:
    """``/api/paths``'s ``paths``: a JSON list of ``[store or null, tree_id, leaf or
    null]`` (2 to ``MAX_PATHS`` of them); ``ValueError`` naming what is wrong."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("paths must be a JSON list of [store, tree_id, leaf]") from None
    if not isinstance(items, list) or not 2 <= len(items) <= MAX_PATHS:
        raise ValueError(f"paths must be a JSON list of 2 to {MAX_PATHS} [store, tree_id, "
                         "leaf] triples")
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], str)
                and (item[0] is None or isinstance(item[0], str))
                and (item[2] is None or (isinstance(item[2], int)
                                         and not isinstance(item[2], bool)))):
            raise ValueError("each path is [store (string or null), tree_id (string), leaf "
                             "(integer or null)]")
        out.append((item[0], item[1], None if item[2] is None
                    else node_id(str(item[2]), "leaf")))
    return out


def answer(data: ViewerData | ViewerStores, path: str, query: dict[str, list[str]]) -> Any:
    """The JSON answer of one API route (``KeyError``: unknown store/tree/node/method/
    route; ``ValueError``: bad input). Shared by the server and the static export."""
    def arg(name: str, required: bool = True) -> str:
        values = query.get(name)
        if not values or not values[0]:
            if required:
                raise ValueError(f"missing query parameter {name!r}")
            return ""
        return values[0]

    stores = ViewerStores.of(data)
    if path == "/api/stores":
        return stores.summary()
    if path == "/api/paths":
        return stores.compare(path_specs(arg("paths")))
    if path == "/api/metrics_diff":
        return stores.metrics_diff((arg("store_a", False) or None, arg("a")),
                                   (arg("store_b", False) or None, arg("b")))
    one = stores.get(arg("store", False) or None)
    if path == "/api/summary":
        return one.summary()
    if path == "/api/runs":
        return one.runs()
    if path == "/api/trees":
        return one.trees(arg("where", False) or None, arg("run", False) or None)
    if path == "/api/tree":
        return one.tree(arg("id"))
    if path == "/api/compare":
        return one.compare(arg("tree"), arg("a"), arg("b"))
    if path == "/api/metrics":
        return one.metrics(arg("run"))
    if path == "/api/labels":
        return one.labels(arg("tree"))
    if path == "/api/siblings":
        ref = arg("ref", False)
        return one.sibling_diff(arg("tree"), node_id(arg("node")),
                                node_id(ref, "ref") if ref else None)
    raise KeyError(f"no route {path}")


class ViewerServer(ThreadingHTTPServer):
    """The HTTP server with its ``ViewerData``, access token and label token."""

    daemon_threads = True
    request_queue_size = REQUEST_QUEUE

    def __init__(self, data: ViewerData | ViewerStores, port: int = 0,
                 on_label: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        super().__init__((HOST, port), ViewerHandler)
        self.stores = ViewerStores.of(data)
        self.data = self.stores.first
        self.access_token = secrets.token_urlsafe(32)  # every route; in login_url only
        self.token = secrets.token_urlsafe(24)  # the label token, X-Rtrees-Token
        self.on_label = on_label

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        """The server's address, without the access token (answers 403 alone)."""
        return f"http://{HOST}:{self.port}/"

    @property
    def login_url(self) -> str:
        """The page's URL with the access token: for the owner's eyes only."""
        return f"{self.url}?{TOKEN_PARAM}={self.access_token}"

    @property
    def cookie_name(self) -> str:
        # cookies are not scoped by port: one name per server keeps two viewers apart
        return f"rtrees-view-{self.port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """An exception outside the routes (the client hung up mid-request): one line on
        stderr for anything but a closed or timed-out connection, never a traceback."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, ConnectionError | TimeoutError):
            print(f"rtrees view: request from {client_address[0]} failed: "
                  f"{type(exc).__name__}: {one_line(exc or '')}", file=sys.stderr)


class ViewerHandler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT  # the socket's: a client that stops sending is dropped

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the CLI prints the URL, not one line per request

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").lower()
        return host in (f"{HOST}:{self.server.port}", f"localhost:{self.server.port}")

    def _cookie_token(self) -> str:
        """The access token of this server's cookie, or ""."""
        for header in self.headers.get_all("Cookie") or []:
            for part in header.split(";"):
                name, _, value = part.strip().partition("=")
                if name == self.server.cookie_name:
                    return value.strip()
        return ""

    def _send(self, status: int, body: bytes, ctype: str,
              headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Content-Security-Policy",
                             "default-src 'self'; img-src 'self' data:; connect-src 'self'")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if status >= 400:  # an unread request body must not become the next request
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:  # the client hung up: nobody to answer
            self.close_connection = True

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj, default=str).encode(), "application/json",
                   headers)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """``http.server``'s own errors (a malformed request line, an unknown method) as
        one line of JSON too, not its HTML page."""
        short = self.responses.get(code, ("error", ""))[0]
        self.close_connection = True
        self._json(code, {"error": one_line(message or short)})

    def _authorised(self, query: dict[str, list[str]]) -> tuple[bool, dict[str, str]]:
        """Whether the request carries the access token (``?token=`` or the cookie), and
        the ``Set-Cookie`` header to send when it came in the URL."""
        secret = self.server.access_token
        given = query.get(TOKEN_PARAM, [])
        if given and same_secret(given[0], secret):
            return True, {"Set-Cookie": f"{self.server.cookie_name}={secret}; Path=/; "
                                        "HttpOnly; SameSite=Strict"}
        cookie = self._cookie_token()
        return bool(cookie) and same_secret(cookie, secret), {}

    def _handle(self, route: Callable[[str, dict[str, list[str]], dict[str, str]], None]
                ) -> None:
        """Check Host and access, then run ``route(path, query, headers)``; turn every
        exception into a one-line JSON error."""
        try:
            if not self._host_ok():
                raise RequestError(HTTPStatus.FORBIDDEN, "bad Host header")
            url = urlsplit(self.path)
            if len(url.query) > MAX_QUERY:
                raise RequestError(HTTPStatus.REQUEST_URI_TOO_LONG,
                                   f"a query string is at most {MAX_QUERY} bytes")
            query = parse_qs(url.query)
            ok, headers = self._authorised(query)
            if not ok:
                raise RequestError(HTTPStatus.FORBIDDEN,
                                   "missing or wrong access token: open the URL "
                                   "`rtrees view` printed (it ends in ?token=...)")
            route(url.path, query, headers)
        except RequestError as exc:
            self._json(exc.status, {"error": one_line(exc)})
        except KeyError as exc:  # an unknown tree, method or route
            self._json(HTTPStatus.NOT_FOUND,
                       {"error": one_line(str(exc.args[0]) if exc.args else "not found")})
        except (ValueError, StoreError) as exc:  # FilterError, TreeValidationError
            self._json(HTTPStatus.BAD_REQUEST, {"error": one_line(exc)})
        except Exception as exc:  # a bug of ours: say so in one line, keep serving
            msg = f"internal error: {type(exc).__name__}: {one_line(exc)}"
            print(f"rtrees view: {self.command} {urlsplit(self.path).path}: {msg}",
                  file=sys.stderr)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": msg})

    def do_GET(self) -> None:
        self._handle(self._get)

    def do_POST(self) -> None:
        self._handle(self._post)

    def _get(self, path: str, query: dict[str, list[str]], headers: dict[str, str]
             ) -> None:
        if path in ("/", "/index.html"):
            token = self.server.token if self.server.on_label else ""  # no token: no form
            self._send(HTTPStatus.OK, page_html(token).encode(), "text/html; charset=utf-8",
                       headers)
            return
        if path.startswith("/static/"):
            name = path[len("/static/"):]
            if name not in STATIC_FILES:
                raise RequestError(HTTPStatus.NOT_FOUND, f"no file {name!r}")
            self._send(HTTPStatus.OK, static_text(name).encode(),
                       STATIC_FILES[name] + "; charset=utf-8", headers)
            return
        self._json(HTTPStatus.OK, answer(self.server.stores, path, query), headers)

    def _post(self, path: str, query: dict[str, list[str]], headers: dict[str, str]
              ) -> None:
        if not same_secret(self.headers.get(TOKEN_HEADER, ""), self.server.token):
            raise RequestError(HTTPStatus.FORBIDDEN, f"missing or wrong {TOKEN_HEADER}")
        if path != "/api/label" or self.server.on_label is None:
            raise RequestError(HTTPStatus.NOT_FOUND, "no such route")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
        if not 0 < length <= MAX_BODY:
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"a label request is 1 byte to {MAX_BODY // 1024} KiB of JSON")
        try:
            body = json.loads(self.rfile.read(length))  # JSONDecodeError: a ValueError
        except RecursionError:  # 64 KiB of "[": deeper than json's recursion limit
            raise ValueError("a label request is nested too deeply") from None
        if not isinstance(body, dict):
            raise ValueError("a label request is a JSON object")
        self._json(HTTPStatus.OK, self.server.on_label(body), headers)


def label_writer(data: ViewerData | ViewerStores, author: str | None = None
                 ) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ``POST /api/label`` action: ``{"tree_id", "node_id" (or null), "key", "value"
    (null clears), "store" (optional: a name of ``/api/stores``, default the first)}``
    appended with ``rollout_store.labels`` under ``author`` (default: the user this process
    runs as, ``server_user``; an ``author`` in the request is ignored: whoever holds the
    page writes as the server's owner); the view is re-pinned so the page reads it back;
    answers the tree's labels. ``ValueError`` for bad input."""
    from rollout_store.labels import write_labels

    who = author or server_user()
    stores = ViewerStores.of(data)

    def write(body: dict[str, Any]) -> dict[str, Any]:
        tree_id, node_id, key = body.get("tree_id"), body.get("node_id"), body.get("key")
        value, store = body.get("value"), body.get("store")
        if not isinstance(tree_id, str) or not isinstance(key, str):
            raise ValueError("a label needs tree_id and key (strings)")
        if node_id is not None and (not isinstance(node_id, int) or isinstance(node_id, bool)):
            raise ValueError("node_id must be an integer or null")
        if node_id is not None and not 0 <= node_id <= MAX_NODE_ID:
            raise ValueError(f"node_id must be in 0..{MAX_NODE_ID}")
        if value is not None and not isinstance(value, str):
            raise ValueError("value must be a string or null")
        if store is not None and not isinstance(store, str):
            raise ValueError("store must be a string or null")
        one = stores.get(store)
        write_labels(one.store, tree_id, node_id, {key: value}, who)
        one.reload()
        return one.labels(tree_id)

    return write


StoresLike = Store | str | Path | Sequence[Store | str | Path] | Mapping[str, Store | str | Path]


def _stores(store: StoresLike) -> ViewerStores:
    """One store, a list of them (named by path), or {name: store}."""
    if isinstance(store, Mapping):
        return ViewerStores(store)
    return ViewerStores([store] if isinstance(store, Store | str | Path) else list(store))


def start(store: StoresLike, port: int = 0, labels: bool = True
          ) -> tuple[ViewerServer, threading.Thread]:
    """Serve ``store`` (or several: a list, the first the default) on
    ``127.0.0.1:port`` (0: a free port) from a background thread; stop with
    ``server.shutdown()``. ``labels``: the page may append labels. Open
    ``server.login_url`` (it holds the access token)."""
    data = _stores(store)
    server = ViewerServer(data, port, label_writer(data) if labels else None)
    thread = threading.Thread(target=server.serve_forever, name="rtrees-view", daemon=True)
    thread.start()
    return server, thread


def serve(store: StoresLike, port: int = 0,
          on_ready: Callable[[str], None] | None = None, labels: bool = True) -> None:
    """Serve ``store`` (or several) until interrupted; ``on_ready(url)`` once the socket
    listens, with the URL that holds the access token (show it to the owner only)."""
    data = _stores(store)
    server = ViewerServer(data, port, label_writer(data) if labels else None)
    if on_ready is not None:
        on_ready(server.login_url)
    try:
        server.serve_forever()
    finally:
        server.server_close()
