"""``rtrees view`` under hostile input (issue 50): the server is its owner's alone, every
failure is a one-line JSON answer, and it keeps answering under load.

* another local account (uid 65534, run from a subprocess as that user: the tests run as
  root, as CI does) gets 403 on every route and cannot write a label;
* the owner's tokened URL sets an HttpOnly, SameSite=Strict cookie; a label's author is
  the server's user, whatever the request body says;
* filters that pass the checker and fail when run, out-of-range node ids, malformed
  requests and a bug in a route are JSON errors (400 / 403 / 414 / 500 / 501), never a
  dropped connection nor a traceback;
* 200 concurrent requests all get answers; a client that stops sending is dropped.

The store is ``tests/viewer_store.py``.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import viewer_store  # tests/viewer_store.py

from analysis.viewer.data import ViewerData
from analysis.viewer.server import (
    MAX_QUERY,
    TOKEN_HEADER,
    ViewerHandler,
    ViewerServer,
    server_user,
    start,
)

NOBODY = 65534


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ViewerServer]:
    """One server for the module (its tests write no label but the owner's one)."""
    path = tmp_path_factory.mktemp("auth") / "store"
    viewer_store.build(path)
    path.chmod(0o700)  # the owner's store: other accounts cannot even list it
    server, thread = start(path)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def owner(server: ViewerServer) -> dict[str, str]:
    """The headers of the owner's page requests: the cookie the tokened URL set."""
    return {"Cookie": f"{server.cookie_name}={server.access_token}"}


def request(server: ViewerServer, method: str, path: str, headers: dict[str, str] | None = None,
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: status, headers, body. A dropped connection
    raises (``http.client.RemoteDisconnected``), which is what these tests rule out."""
    con = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        con.request(method, path, body=body, headers=headers or {})
        r = con.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        con.close()


def json_error(body: bytes) -> str:
    """The error of a one-line JSON error body."""
    text = body.decode()
    assert "\n" not in text.strip(), text
    return str(json.loads(text)["error"])


def label(server: ViewerServer, body: dict[str, Any] | bytes,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {**owner(server), TOKEN_HEADER: server.token, "Content-Type": "application/json",
         **(headers or {})}
    status, _, out = request(server, "POST", "/api/label", h, data)
    return status, out


# ---- another account of the machine

ROUTES = ["/", "/index.html", "/static/viewer.js", "/static/viewer.css", "/api/summary",
          "/api/runs", "/api/trees", "/api/trees?where=1%3D1", "/api/tree?id=bel-0",
          "/api/compare?tree=bel-0&a=grpo&b=tree_grpo",
          f"/api/metrics?run={viewer_store.TRAIN_RUN}", "/api/labels?tree=bel-0",
          "/api/no-such-route", "/?token=wrong", "/api/tree?id=bel-0&token="]

# Run as uid 65534 with a stdlib-only Python: every route of the server, then two label
# writes (with the page's label token even, and a forged author); prints the answers.
INTRUDER = r"""
import json, os, sys, urllib.error, urllib.request
base, cookie_name, label_token, store, routes = sys.argv[1:6]
out = {"uid": os.geteuid(), "answers": []}
try:
    os.listdir(store)
    out["store_listed"] = True
except PermissionError:
    out["store_listed"] = False
def ask(method, path, headers, data=None):
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return [method, path, r.status, r.read().decode("utf-8", "replace")]
    except urllib.error.HTTPError as e:
        return [method, path, e.code, e.read().decode("utf-8", "replace")]
    except Exception as e:
        return [method, path, -1, repr(e)]
for path in json.loads(routes):
    out["answers"].append(ask("GET", path, {}))
out["answers"].append(ask("GET", "/api/runs", {"Cookie": cookie_name + "=guess"}))
out["answers"].append(ask("GET", "/api/runs", {"Cookie": cookie_name + "="}))
body = json.dumps({"tree_id": "bel-0", "node_id": 2, "key": "pwned", "value": "yes",
                   "author": "owner"}).encode()
for path in ("/api/label", "/api/label?token=wrong"):
    out["answers"].append(ask("POST", path, {"X-Rtrees-Token": label_token,
                                             "Content-Type": "application/json"}, body))
print(json.dumps(out))
"""


def python_for(uid: int) -> str | None:
    """A Python interpreter that ``uid`` may run (the venv's may sit under /root)."""
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3")]):
        if not exe:
            continue
        try:
            ok = subprocess.run([exe, "-I", "-c", "pass"], user=uid, group=uid,
                                extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                                capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return exe
    return None


def test_another_account_gets_403_everywhere(served: ViewerServer) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a request as another uid (CI runs as root)")
    exe = python_for(NOBODY)
    if exe is None:
        pytest.skip(f"no Python interpreter that uid {NOBODY} may run")
    store = str(served.data.store.path)
    before = served.data.labels("bel-0")["history"]
    res = subprocess.run(
        [exe, "-I", "-c", INTRUDER, served.url.rstrip("/"), served.cookie_name, served.token,
         store, json.dumps(ROUTES)],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["uid"] == NOBODY and out["store_listed"] is False
    assert len(out["answers"]) == len(ROUTES) + 4
    for method, path, status, body in out["answers"]:
        assert status == 403, (method, path, status, body)
        assert "\n" not in body.strip() and json.loads(body)["error"], (path, body)
        assert served.token not in body and served.access_token not in body
        assert "calc-17" not in body and "bel-0" not in body  # no stored text at all
    # nothing was written: the owner's view of the store has the same label history
    fresh = ViewerData(store)
    assert fresh.labels("bel-0")["history"] == before
    assert all(lab["key"] != "pwned" for lab in fresh.labels("bel-0")["nodes"].get(2, []))


# ---- the owner

def test_owner_token_sets_a_strict_cookie_and_owns_the_labels(served: ViewerServer) -> None:
    status, headers, page = request(served, "GET", "/?token=" + served.access_token)
    assert status == 200 and served.token.encode() in page
    cookie = [p.strip() for p in headers["set-cookie"].split(";")]
    assert cookie[0] == f"{served.cookie_name}={served.access_token}"
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(cookie[1:])
    # the cookie alone opens every route; the token alone too (it is the URL printed)
    for path in ROUTES[:12]:
        assert request(served, "GET", path, owner(served))[0] == 200, path
    status, _, body = request(served, "GET", "/api/runs?token=" + served.access_token)
    assert status == 200 and json.loads(body)
    # another viewer's cookie (another port) opens nothing here
    other = {"Cookie": f"rtrees-view-{served.port + 1}={served.access_token}"}
    assert request(served, "GET", "/api/runs", other)[0] == 403
    # the author is the user the server runs as, not what the body says
    status, body = label(served, {"tree_id": "bel-0", "node_id": 2, "key": "verdict",
                                  "value": "ok", "author": "mallory"})
    assert status == 200, body
    me = server_user()
    assert me != "mallory" and json.loads(body)["nodes"]["2"][0]["author"] == me
    stored = ViewerData(str(served.data.store.path)).labels("bel-0")["nodes"][2]
    assert [(lab["key"], lab["value"], lab["author"]) for lab in stored] == \
        [("verdict", "ok", me)]
    if hasattr(os, "geteuid"):
        import pwd

        assert me == pwd.getpwuid(os.geteuid()).pw_name
    # the label token alone (without the access cookie) writes nothing
    status, _, body = request(served, "POST", "/api/label",
                              {TOKEN_HEADER: served.token, "Content-Type": "application/json"},
                              json.dumps({"tree_id": "bel-0", "key": "k", "value": "v"})
                              .encode())
    assert status == 403 and "access token" in json_error(body)


# ---- failing filters, bad ids, malformed requests: JSON errors, never a dropped line

# pass the checker, fail on the rows (DuckDB 1.x/2.x): each is a 400 naming the failure
FAILING_FILTERS = [
    "regexp_matches(task_id, '(')",  # a bad regex
    "tree_id ~ '('",
    "n_nodes // 0 = 1",  # integer division by zero
    "task_id",  # a VARCHAR column as the boolean
    "CAST(task_id AS INTEGER) = 1",  # a cast that fails
    "task_id = 1",  # a string compared to a number
    "reward > 'abc'",
    "CAST('x' AS DATE) IS NULL",
]
# SQL answers these with NULL or NaN in this DuckDB; whatever it does, the page gets JSON
ODD_FILTERS = ["1/0 = 1", "sqrt(-1) > 0", "ln(-1) < 0", "n_nodes * 9223372036854775807 > 0"]


@pytest.mark.parametrize("text", FAILING_FILTERS)
def test_a_filter_failing_at_run_time_is_400(served: ViewerServer, text: str) -> None:
    status, _, body = request(served, "GET", "/api/trees?where=" + urllib.parse.quote(text),
                              owner(served))
    assert status == 400 and json_error(body).startswith("filter failed: ")
    # the connection (and DuckDB's) still serves the next question
    status, _, body = request(served, "GET", "/api/trees?where=" +
                              urllib.parse.quote("sampler = 'bel'"), owner(served))
    assert status == 200 and [t["tree_id"] for t in json.loads(body)["trees"]] == ["bel-0"]


@pytest.mark.parametrize("text", ODD_FILTERS)
def test_an_odd_filter_is_answered(served: ViewerServer, text: str) -> None:
    status, _, body = request(served, "GET", "/api/trees?where=" + urllib.parse.quote(text),
                              owner(served))
    assert status in (200, 400), body
    assert "trees" in json.loads(body) if status == 200 else json_error(body)


@pytest.mark.parametrize("body,status,error", [
    ({"tree_id": "bel-0", "node_id": 2**70, "key": "k", "value": "v"}, 400, "node_id must"),
    ({"tree_id": "bel-0", "node_id": 2**63, "key": "k", "value": "v"}, 400, "node_id must"),
    ({"tree_id": "bel-0", "node_id": -(2**70), "key": "k", "value": "v"}, 400,
     "node_id must"),
    ({"tree_id": "bel-0", "node_id": -1, "key": "k", "value": "v"}, 400, "node_id must"),
    ({"tree_id": "bel-0", "node_id": 77, "key": "k", "value": "v"}, 400, "unknown_node"),
    ({"tree_id": "bel-0", "node_id": 1.5, "key": "k", "value": "v"}, 400, "node_id must"),
    ({"tree_id": "nope", "node_id": None, "key": "k", "value": "v"}, 400, "unknown_tree"),
    ({"tree_id": "bel-0", "node_id": None, "key": " ", "value": "v"}, 400, "label key"),
    (b"[1, 2]", 400, "a JSON object"),
    (b"{not json", 400, "Expecting property name"),
    (b"\xff\xfe\x00", 400, ""),
    (b"1e999999", 400, "a JSON object"),
    (b"x" * 70_000, 400, "1 byte to 64 KiB"),
    (b"[" * 60_000, 400, "nested too deeply"),
    (b'{"tree_id": "bel-0", "key": "k", "value": ' + b"[" * 60_000, 400, "nested"),
])
def test_a_bad_label_request_is_400(served: ViewerServer, body: dict[str, Any] | bytes,
                                    status: int, error: str) -> None:
    before = served.data.labels("bel-0")["history"]
    got, out = label(served, body)
    assert got == status and error in json_error(out)
    assert served.data.labels("bel-0")["history"] == before  # nothing written


@pytest.mark.parametrize("headers,status,error", [
    ({TOKEN_HEADER: "\u00e9t\u00e9"}, 403, "X-Rtrees-Token"),  # non-ASCII: no TypeError
    ({TOKEN_HEADER: ""}, 403, "X-Rtrees-Token"),
    ({"Content-Length": "abc"}, 400, "Content-Length"),
    ({"Content-Length": "-5"}, 400, "1 byte to 64 KiB"),
    ({"Cookie": "\u00e9=\u00e9; ;=;x"}, 403, "access token"),  # and no owner cookie
])
def test_bad_label_headers(served: ViewerServer, headers: dict[str, str], status: int,
                           error: str) -> None:
    h = {**owner(served), TOKEN_HEADER: served.token, **headers}
    con = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:  # putheader: the bad Content-Length as given, not one http.client computes
        con.putrequest("POST", "/api/label")
        for k, v in h.items():
            con.putheader(k, v.encode("latin-1"))
        if "Content-Length" not in headers:
            con.putheader("Content-Length", "2")
        con.endheaders(b"{}")
        r = con.getresponse()
        got, body = r.status, r.read()
    finally:
        con.close()
    assert got == status and error in json_error(body)


@pytest.mark.parametrize("path,statuses,error", [
    ("/api/tree?id=%00", {404}, "no tree"),
    ("/api/tree?id=%FF%FE", {404}, "no tree"),
    ("/api/tree?id=" + "x" * 10_000, {404}, "no tree"),
    ("/api/tree?id=", {400}, "missing query parameter 'id'"),
    ("/api/compare?tree=bel-0&a=grpo&b=%00", {404}, "no credit of method"),
    ("/api/labels?tree=%00", {200}, ""),
    ("/api/metrics?run=" + "%C0" * 100, {200}, ""),
    ("/api/trees?where=" + "x" * (MAX_QUERY + 1), {414}, f"at most {MAX_QUERY}"),
    # long or deep: the filter checker's limits decide, the answer is JSON either way
    ("/api/trees?where=" + urllib.parse.quote("1=1 OR " * 1000 + "true"), {200, 400}, ""),
    ("/api/trees?where=" + "(" * 3000 + "1" + ")" * 3000, {200, 400}, ""),
    ("/api/trees?where=" + "(" * 1990 + "1" + ")" * 1990, {200, 400}, ""),
    ("/api/trees?where=" + "NOT%20" * 990 + "true", {200, 400}, ""),
])
def test_hostile_query_parameters(served: ViewerServer, path: str, statuses: set[int],
                                  error: str) -> None:
    got, _, body = request(served, "GET", path, owner(served))
    assert got in statuses, body[:300]
    if got != 200:
        assert error in json_error(body)
    else:
        json.loads(body)


def test_malformed_requests_are_json(served: ViewerServer) -> None:
    """``http.server``'s own errors (an unknown method, a bad request line) as one line
    of JSON, not its HTML page."""
    status, headers, body = request(served, "PUT", "/api/label", owner(served), b"{}")
    assert status == 501 and headers["content-type"] == "application/json"
    assert "Unsupported method" in json_error(body)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(b"GET /a b HTTP/1.1\r\n\r\n")  # four words: bad request syntax
        raw = b""
        while chunk := s.recv(65_536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json_error(body)


def test_a_bug_in_a_route_is_500_in_one_line(served: ViewerServer,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    def broken() -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(served.data, "summary", broken)
    status, _, body = request(served, "GET", "/api/summary", owner(served))
    assert status == 500 and json_error(body) == "internal error: RuntimeError: boom"
    assert request(served, "GET", "/api/runs", owner(served))[0] == 200  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == ["rtrees view: GET /api/summary: internal error: "
                                "RuntimeError: boom"]


# ---- load and slow clients

def test_200_concurrent_requests_all_answered(served: ViewerServer) -> None:
    n = 200
    barrier = threading.Barrier(n, timeout=60)

    def one(i: int) -> int:
        barrier.wait()  # all connect at once: the listen backlog takes the burst
        path = "/api/summary" if i % 2 else "/static/viewer.css"
        return request(served, "GET", path, owner(served))[0]

    with ThreadPoolExecutor(max_workers=n) as pool:
        statuses = list(pool.map(one, range(n)))
    assert statuses == [200] * n
    assert served.request_queue_size >= 128


def test_a_silent_client_is_dropped(served: ViewerServer,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that opens a connection and stops sending holds a thread only until the
    socket timeout (``REQUEST_TIMEOUT``; here shortened)."""
    monkeypatch.setattr(ViewerHandler, "timeout", 0.5)
    with socket.create_connection(("127.0.0.1", served.port), timeout=20) as s:
        s.sendall(b"GET /api/summary HTTP/1.1\r\nHost: 127.0.0.1")  # never finished
        assert s.recv(1024) == b""  # the server closed it (a hang would time out here)


def test_the_cli_prints_the_tokened_url_only(tmp_path: Path) -> None:
    """``rtrees view`` prints the URL with the access token; the URL without it is 403."""
    store = tmp_path / "store"
    viewer_store.build(store)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "view", "--store", str(store),
                             "--port", "0", "--no-labels"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "rtrees view printed nothing in 120 s"
        line = proc.stdout.readline()
        url = next(w for w in line.split() if w.startswith("http://"))
        parts = urllib.parse.urlsplit(url)
        token = urllib.parse.parse_qs(parts.query)["token"][0]
        assert parts.hostname == "127.0.0.1" and len(token) >= 32
        con = http.client.HTTPConnection("127.0.0.1", parts.port, timeout=30)
        con.request("GET", "/")
        r = con.getresponse()
        assert r.status == 403 and token not in r.read().decode()
        con.request("GET", f"/?{parts.query}")
        r = con.getresponse()
        page = r.read().decode()
        assert r.status == 200 and 'name="rtrees-token" content=""' in page  # --no-labels
        con.close()
    finally:
        proc.terminate()
        proc.wait(30)
