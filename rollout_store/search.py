"""Search a store's trees (``rtrees search``, issue 26): text by regex, tokens by id.

* ``search_regex(store, pattern)``: nodes whose ``action_text`` or ``observation_text``
  matches ``pattern`` (RE2 syntax, DuckDB's ``regexp_matches``; the pattern is a bound
  parameter, never SQL text), with the character offset of the first match
  (0-based, in that text).
* ``search_tokens(store, ids)``: every place where the token ids ``ids`` occur
  contiguously in the token stream of a root-to-leaf path, crossing node boundaries.
  A node's stream is its action tokens then its observation tokens (the root: the
  prompt's observation tokens), and a path's stream is its nodes' streams in order, so
  a match may start in one node's action, run through its observation and end in a
  child's action. Each hit is ``(tree_id, node_id, offset, end_node_id)``: the node where
  the match starts, the offset in that node's stream (action positions first), and the
  node where it ends; a match that continues into several children is one hit per
  child it ends in (its start is shared).

How the token search is fast (benchmarks/bench_search.py: 1M nodes): the search runs
over a ``TokenIndex``, the two token columns as flat arrays with their offsets and the
children of every node as CSR arrays, built from one read of the ``nodes`` table and,
for a local store, kept in ``<store>/.search-index/`` for the store version it was
built at and memory-mapped by later searches (decoding the Parquet token columns is
most of a cold search). Candidates are the positions equal to ``ids[0]`` (one
vectorised comparison); a candidate whose match fits inside its segment is verified by
``len(ids) - 1`` vectorised gathers; only the few candidates whose prefix matches up to
their segment's end are followed into the next segments (the node's observation, then
each child's action) in Python.

Limits (issue 50): a regex is at most ``MAX_PATTERN`` (1,000) characters and a token run
at most ``MAX_TOKEN_IDS`` (1,000) ids (``ValueError`` past either). Length alone does not
bound a regex's time: RE2 runs a large pattern on its slower NFA, and ``.{1000}`` (7
characters) costs about as much per byte of text as a 1,000-character one (25 us a byte
here: 4 MB of text took minutes). So ``search_regex`` runs the query in a child process
and kills it at a deadline (``timeout_s``, default ``REGEX_TIMEOUT_S`` = 30 s, child start
included): ``QueryLimitError``, one line. (DuckDB's own interrupt is looked at only
between vectors of 2,048 rows, and one vector of long texts can take minutes.)

The index is the store's own: ``<store>/.search-index`` and the ``trees*-nodes*`` folders
in it are used only as plain directories of this store. A symbolic link (or anything not a
directory) in their place is refused with ``StoreError`` before anything is deleted, and
every removal, write and read goes through a directory descriptor opened without
following links (``O_NOFOLLOW``), so nothing outside the store is touched even when the
folder is swapped mid-search. A store this process may not write (a read-only file
system, no write access, or a directory without any write permission bit: ``chmod 555``
holds even for root) is searched without writing: the index is built in memory, and an
index already there is only read.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_store.errors import StoreError
from rollout_store.reader import StoreLike, as_store, connect, read_arrow
from rollout_store.sqlguard import QueryLimitError
from rollout_store.store import Store, StoreVersion

MAX_PATTERN = 1_000  # characters of a --regex pattern (issue 50: 30k took 15 s on 4 MB)
MAX_TOKEN_IDS = 1_000  # ids of a --tokens run: the scan makes one gather per id
REGEX_TIMEOUT_S = 30.0  # default deadline of search_regex, seconds (module docstring)

TOKEN_HITS = pa.schema([pa.field("tree_id", pa.string()), pa.field("node_id", pa.int64()),
                        pa.field("offset", pa.int64()), pa.field("end_node_id", pa.int64())])
TEXT_HITS = pa.schema([pa.field("tree_id", pa.string()), pa.field("node_id", pa.int64()),
                       pa.field("field", pa.string()), pa.field("offset", pa.int64())])


@dataclass(frozen=True)
class SearchResult:
    """The first ``limit`` hits (``hits``) and how many there are in all (``total``)."""

    hits: pa.Table
    total: int

    def summary(self) -> str:
        shown = self.hits.num_rows
        return f"{self.total} hits" + (f" (first {shown} shown)" if shown < self.total else "")


def search_regex(store: StoreLike, pattern: str, limit: int = 100,
                 version: StoreVersion | int | None = None,
                 timeout_s: float | None = REGEX_TIMEOUT_S) -> SearchResult:
    """Nodes whose action or observation text matches ``pattern`` (module docstring);
    one hit per (node, field).

    ``pattern`` is at most ``MAX_PATTERN`` (1,000) characters (``ValueError``); a bad
    pattern is DuckDB's ``InvalidInputException``, raised before the search starts. The
    search runs in a child process killed after ``timeout_s`` seconds (``QueryLimitError``;
    the module docstring says why); ``timeout_s=None`` runs it in this process, unbounded,
    for patterns you trust (benchmarks)."""
    import duckdb

    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"regex of {len(pattern):,} characters: at most {MAX_PATTERN:,}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"search timeout must be > 0 seconds, got {timeout_s}")
    with duckdb.connect() as check:  # compiles the pattern only: a bad one fails here
        check.execute("SELECT regexp_matches('', $p)", {"p": pattern})
    s = as_store(store)
    pinned = s.resolve(version)
    if timeout_s is None:
        return _regex_hits(s, pattern, limit, pinned)
    return _regex_in_child(s, pattern, limit, pinned, timeout_s)


def _regex_hits(store: Store, pattern: str, limit: int, version: StoreVersion
                ) -> SearchResult:
    """The regex search proper, in this process."""
    con = connect(store, version, restricted=True)
    sql = """
        WITH hits AS (
            SELECT tree_id, node_id, 'action' AS field,
                   strpos(action_text, regexp_extract(action_text, $p)) - 1 AS "offset"
            FROM nodes WHERE regexp_matches(action_text, $p)
            UNION ALL
            SELECT tree_id, node_id, 'observation',
                   strpos(observation_text, regexp_extract(observation_text, $p)) - 1
            FROM nodes WHERE regexp_matches(observation_text, $p))
        SELECT *, count(*) OVER () AS total FROM hits
        ORDER BY tree_id, node_id, field LIMIT $n"""
    table = con.sql(sql, params={"p": pattern, "n": int(limit)}).to_arrow_table()
    total = int(table.column("total")[0].as_py()) if table.num_rows else 0
    hits = table.drop_columns(["total"]).cast(TEXT_HITS)
    return SearchResult(hits, total)


def _regex_in_child(store: Store, pattern: str, limit: int, version: StoreVersion,
                    timeout_s: float) -> SearchResult:
    """``_regex_hits`` in a fresh interpreter (``_regex_child``), killed at ``timeout_s``.

    The request goes in as JSON on stdin, the hits come back as an Arrow IPC stream on
    stdout (``total`` in its metadata), an error as one line on stderr. A fresh
    interpreter rather than ``multiprocessing``: a fork would copy DuckDB's and
    deltalake's threads, and spawn re-imports the caller's ``__main__``."""
    request = json.dumps({"store": str(store.path), "pattern": pattern, "limit": int(limit),
                          "version": dict(version)})
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[1])  # the checkout holding rollout_store
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", "from rollout_store.search import _regex_child; _regex_child()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        out, err = child.communicate(request.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise QueryLimitError(f"regex search exceeded {timeout_s:g} s (the time limit; "
                              "see --timeout)") from None
    except BaseException:  # Ctrl-C: never leave the child running
        child.kill()
        child.wait()
        raise
    if child.returncode != 0:
        lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        raise StoreError(f"regex search failed after {time.monotonic() - start:.1f} s: "
                         f"{lines[-1] if lines else f'exit status {child.returncode}'}")
    table = pa.ipc.open_stream(out).read_all()
    total = int((table.schema.metadata or {}).get(b"total", b"0"))
    return SearchResult(table.replace_schema_metadata(None).cast(TEXT_HITS), total)


def _regex_child() -> None:
    """The child side of ``_regex_in_child`` (run as ``python -c``)."""
    req = json.loads(sys.stdin.read())
    try:
        res = _regex_hits(as_store(req["store"]), req["pattern"], req["limit"],
                          StoreVersion({k: int(v) for k, v in req["version"].items()}))
    except Exception as exc:  # one line for the parent; it re-raises with the store's name
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
        sys.stderr.write(f"{type(exc).__name__}: {first}\n")
        sys.exit(1)
    table = res.hits.replace_schema_metadata({"total": str(res.total)})
    with pa.ipc.new_stream(sys.stdout.buffer, table.schema) as writer:
        writer.write_table(table)


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list<int32> column: node i's tokens are
    ``values[offsets[i]:offsets[i + 1]]``; a null list is empty."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    assert isinstance(arr, pa.ListArray)
    arr = pc.fill_null(arr, pa.scalar([], arr.type)) if arr.null_count else arr
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)  # int32, no copy
    values = values[offsets[0]:offsets[-1]] if len(offsets) else values[:0]
    return values, offsets - offsets[0]


TOKEN_COLUMNS = ("tree_id", "node_id", "parent_id", "action_token_ids",
                 "observation_token_ids")
INDEX_DIR = ".search-index"  # in a local store's directory; not a table (see TokenIndex)
_ARRAYS = ("action", "action_offsets", "observation", "observation_offsets", "node_ids",
           "kids", "first")


@dataclass(frozen=True)
class TokenIndex:
    """The flat arrays the token search scans, for the committed nodes of one version.

    ``action[action_offsets[r]:action_offsets[r + 1]]`` are row r's action tokens (int32),
    the same for ``observation``; ``tree_ids`` / ``node_ids`` name the rows; row r's
    children are ``kids[first[r]:first[r + 1]]``. Built from the ``nodes`` table in one
    read (``from_nodes``); for a local store it is saved under ``<store>/.search-index/``
    keyed by the ``trees`` and ``nodes`` table versions (which fix the visible rows) and
    memory-mapped by later searches of that version (``load_index``), so a warm search
    reads no Parquet. A new version builds a new index and removes the old ones.
    """

    action: np.ndarray
    action_offsets: np.ndarray
    observation: np.ndarray
    observation_offsets: np.ndarray
    node_ids: np.ndarray
    kids: np.ndarray
    first: np.ndarray
    tree_ids: pa.Array

    @staticmethod
    def from_nodes(nodes: pa.Table) -> TokenIndex:
        a, ao = _flat(nodes.column("action_token_ids"))
        o, oo = _flat(nodes.column("observation_token_ids"))
        kids, first = _children(nodes)
        return TokenIndex(a, ao, o, oo, np.asarray(nodes.column("node_id").to_numpy(),
                                                   dtype=np.int64),
                          kids, first, nodes.column("tree_id").combine_chunks())

    def save(self, folder: Path) -> None:
        """Write the arrays (``.npy``) and tree ids (Arrow IPC) into ``folder`` atomically
        (a temporary sibling renamed into place), following no symbolic link: the parent
        must be a plain directory and ``folder`` must not exist as a link."""
        with _open_dir(folder.parent) as parent:
            self._save_at(parent, folder.name)

    def _save_at(self, parent: int, name: str) -> None:
        """``save`` into ``parent`` (a directory descriptor) as ``name``."""
        tmp = f"{name}.tmp-{uuid.uuid4().hex[:8]}"
        os.mkdir(tmp, 0o755, dir_fd=parent)
        try:
            with _open_dir(tmp, parent) as folder:
                for array in _ARRAYS:
                    with _create(folder, f"{array}.npy") as f:
                        np.save(f, np.ascontiguousarray(getattr(self, array)))
                with _create(folder, "tree_ids.arrow") as f, \
                        pa.ipc.new_file(f, pa.schema([("tree_id", pa.string())])) as w:
                    w.write_table(pa.table({"tree_id": self.tree_ids}))
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            shutil.rmtree(tmp, dir_fd=parent, ignore_errors=True)
            if name not in os.listdir(parent):  # not another search's index built meanwhile
                raise

    @staticmethod
    def load(folder: Path) -> TokenIndex:
        """The index saved in ``folder`` (memory-mapped), following no symbolic link."""
        with _open_dir(folder.parent) as parent:
            return TokenIndex._load_at(parent, folder.name)

    @staticmethod
    def _load_at(parent: int, name: str) -> TokenIndex:
        # np.asarray: plain ndarray views of the maps (no copy); indexing an np.memmap runs
        # its Python __getitem__, 0.5 s of a 1.9 s search that followed 150k candidates
        with _open_dir(name, parent) as folder:
            arrays = {array: np.asarray(_map_npy(folder, f"{array}.npy"))
                      for array in _ARRAYS}
            fd = os.open("tree_ids.arrow", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
            try:
                data = pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
            finally:
                os.close(fd)
        tree_ids = pa.ipc.open_file(pa.BufferReader(data)).read_all().column(
            "tree_id").combine_chunks()
        return TokenIndex(tree_ids=tree_ids, **arrays)


_ENTRY = re.compile(r"trees\d+-nodes\d+(\.tmp-[0-9a-f]{8})?")  # what the index holds


@contextmanager
def _open_dir(path: str | Path, parent: int | None = None) -> Iterator[int]:
    """A descriptor of the directory ``path`` (relative to the descriptor ``parent`` if
    given), opened without following a symbolic link in its last component (``ELOOP``)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        yield fd
    finally:
        os.close(fd)


def _create(folder: int, name: str) -> BinaryIO:
    """A new file ``name`` in ``folder`` for writing; never through a link."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                 dir_fd=folder)
    return os.fdopen(fd, "wb")


def _map_npy(folder: int, name: str) -> np.ndarray:
    """``np.load(name, mmap_mode="r")`` through a descriptor opened without following a
    link (``np.load`` maps only a path)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
    with os.fdopen(fd, "rb") as f:
        major, minor = np.lib.format.read_magic(f)
        if (major, minor) == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        if dtype.hasobject:
            raise ValueError(f"{name}: an object array, not an index")
        if not int(np.prod(shape)):
            return np.zeros(shape, dtype)  # mmap cannot map zero bytes
        return np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                         order="F" if fortran else "C")


def _may_write(path: Path) -> bool:
    """Whether the search may write its index into the local store ``path``: not on a
    read-only file system, writable by this process (``os.access``), and with a write
    permission bit set (root passes ``os.access`` on a ``chmod 555`` directory, and a
    store made read-only that way is read-only for the search too)."""
    try:
        mode, flags = os.stat(path).st_mode, os.statvfs(path).f_flag
    except OSError:
        return False
    return not flags & os.ST_RDONLY and bool(mode & 0o222) and os.access(path, os.W_OK)


def _refuse_links(root: Path, parent: int | None = None) -> None:
    """``StoreError`` unless ``root`` (in ``parent``) is a plain directory whose index
    entries are plain directories: a link there is someone else's, never ours to follow
    or delete."""
    why = "a symbolic link" if os.path.islink(root) else "not a directory"
    if parent is None:
        raise StoreError(f"{root}: the search index is {why}; refusing to use it (remove it "
                         "and search again)")
    for entry in os.scandir(parent):
        if _ENTRY.fullmatch(entry.name) and (entry.is_symlink()
                                             or not entry.is_dir(follow_symlinks=False)):
            kind = "a symbolic link" if entry.is_symlink() else "not a directory"
            raise StoreError(f"{root / entry.name}: an entry of the search index is {kind}; "
                             "refusing to use the index (remove it and search again)")


def load_index(store: StoreLike, version: StoreVersion | int | None = None,
               cache: bool = True) -> TokenIndex:
    """The ``TokenIndex`` of ``store`` at ``version`` (latest if None): memory-mapped
    from ``<store>/.search-index/`` when built before, else built from the ``nodes``
    table (and, with ``cache`` on a local store this process may write, saved there,
    the older indexes removed). ``StoreError`` when the index folder or one of its
    entries is a symbolic link or not a directory (module docstring): nothing is read
    through it or deleted."""
    s = as_store(store)
    if not cache or s.loc.remote:
        return TokenIndex.from_nodes(read_arrow(s, "nodes", version, list(TOKEN_COLUMNS)))
    if version is None:  # the two versions that fix the visible nodes (cheaper than all)
        key = {name: s.delta_table(name).version() for name in ("trees", "nodes")}
    else:
        key = dict(s.resolve(version))
    path = Path(str(s.path))
    root = path / INDEX_DIR
    writable = _may_write(path)
    if writable and not os.path.lexists(root):
        try:
            os.mkdir(root, 0o755)  # never follows a link: an existing one is EEXIST
        except FileExistsError:  # another search made it meanwhile
            pass
        except OSError:
            writable = False
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:  # no index and a store we may not write: build in memory
        return _index_in(s, None, key, version, False)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (O_NOFOLLOW), or a file
            _refuse_links(root)
        raise
    try:
        _refuse_links(root, fd)
        return _index_in(s, fd, key, version, writable)
    finally:
        os.close(fd)


def _index_in(s: Store, root: int | None, key: dict[str, int],
              version: StoreVersion | int | None, writable: bool) -> TokenIndex:
    """``load_index`` in the index directory ``root`` (a descriptor; None: there is none):
    read the index of ``key`` if there, else build it and, if ``writable``, save it and
    remove the older ones."""
    name = f"trees{key['trees']}-nodes{key['nodes']}"
    if root is not None and name in os.listdir(root):
        try:
            return TokenIndex._load_at(root, name)
        except (OSError, ValueError, pa.ArrowException):
            if writable:  # damaged: rebuild below
                shutil.rmtree(name, dir_fd=root, ignore_errors=True)
    pinned = s.resolve(version) if version is not None else s.version()
    if {n: pinned[n] for n in key} != key:  # a commit landed meanwhile: index what we read
        name = f"trees{pinned['trees']}-nodes{pinned['nodes']}"
    index = TokenIndex.from_nodes(read_arrow(s, "nodes", pinned, list(TOKEN_COLUMNS)))
    if root is None or not writable:
        return index  # a read-only store: search without the cache
    try:
        for old in os.listdir(root):
            if _ENTRY.fullmatch(old):  # plain directories (_refuse_links), removed by fd
                shutil.rmtree(old, dir_fd=root, ignore_errors=True)
        index._save_at(root, name)
    except OSError:  # the store turned read-only, or a full disk: search without the cache
        pass
    return index


def search_tokens(store: StoreLike, ids: Sequence[int], limit: int = 100,
                  version: StoreVersion | int | None = None, cache: bool = True
                  ) -> SearchResult:
    """Where ``ids`` (1 to ``MAX_TOKEN_IDS`` = 1,000 of them) occur contiguously along a
    root-to-leaf path (module docstring), over the store's ``TokenIndex`` (built on first
    use, then reused; ``cache=False`` reads the ``nodes`` table every time and writes
    nothing; a store this process may not write is never written either)."""
    q = _query(ids, limit)
    return _runs(load_index(store, version, cache), q, limit)


def find_token_runs(nodes: pa.Table, ids: Sequence[int] | np.ndarray, limit: int = 100
                    ) -> SearchResult:
    """``search_tokens`` over a nodes table in memory (``TOKEN_COLUMNS`` at least; trees
    whole, any row order)."""
    q = _query(ids, limit)
    return _runs(TokenIndex.from_nodes(nodes), q, limit)


def _query(ids: Sequence[int] | np.ndarray, limit: int) -> np.ndarray:
    """``ids`` as int64 (1 to ``MAX_TOKEN_IDS`` of them, else ``ValueError``); an id past
    int64 is clipped to it: like any id outside int32 it matches no token (``_runs``)."""
    ints = [int(i) for i in ids]
    if not ints:
        raise ValueError("give at least one token id")
    if len(ints) > MAX_TOKEN_IDS:
        raise ValueError(f"{len(ints):,} token ids: at most {MAX_TOKEN_IDS:,}")
    big = np.iinfo(np.int64)
    q = np.asarray([min(max(i, int(big.min)), int(big.max)) for i in ints], dtype=np.int64)
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    return q


def _runs(index: TokenIndex, q64: np.ndarray, limit: int) -> SearchResult:
    """The search proper (module docstring) over ``index``."""
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if q64.min() < lo or q64.max() > hi:
        return SearchResult(TOKEN_HITS.empty_table(), 0)  # token ids are int32
    q = q64.astype(np.int32)
    vals = [index.action, index.observation]
    offs = [index.action_offsets, index.observation_offsets]
    lens = [np.diff(o) for o in offs]
    m = q.size
    starts: list[tuple[int, int]] = []  # (node row, offset in the node's stream)
    partial: list[tuple[int, int, int]] = []  # (node row, offset, tokens matched so far)
    for part, (v, o) in enumerate(zip(vals, offs, strict=True)):
        cand = np.flatnonzero(v == q[0])
        if cand.size == 0:
            continue
        row = np.searchsorted(o, cand, side="right") - 1
        room = o[row + 1] - cand  # tokens left in the segment from the candidate on
        ok = np.ones(cand.size, dtype=bool)
        for j in range(1, m):
            inside = room > j
            idx = np.where(inside, cand + j, 0)
            ok &= ~inside | (v[idx] == q[j])
        local = cand - o[row] + (lens[0][row] if part == 1 else 0)
        whole = ok & (room >= m)
        starts += list(zip(row[whole].tolist(), local[whole].tolist(), strict=True))
        cut = ok & (room < m)
        partial += list(zip(row[cut].tolist(), local[cut].tolist(),
                            room[cut].tolist(), strict=True))
    hits: list[tuple[int, int, int]] = [(r, off, r) for r, off in starts]
    if partial:
        hits += _cross(index, vals, offs, lens, q, partial)
    hits.sort(key=lambda h: (h[0], h[1], h[2]))
    shown = hits[:int(limit)]
    rows = pa.array([h[0] for h in shown], pa.int64())
    table = pa.table({
        "tree_id": index.tree_ids.take(rows),
        "node_id": pa.array(index.node_ids[[h[0] for h in shown]], pa.int64()),
        "offset": pa.array([h[1] for h in shown], pa.int64()),
        "end_node_id": pa.array(index.node_ids[[h[2] for h in shown]], pa.int64()),
    }).cast(TOKEN_HITS)
    return SearchResult(table, len(hits))


def _children(nodes: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The child rows of every row as CSR arrays (vectorised): row r's children are
    ``kids[first[r]:first[r + 1]]``, in row order. A parent's row is found directly when
    every tree's rows are contiguous with node ids 0, 1, ... in row order (as the writer
    lays trees out): row = the tree's first row + parent id; otherwise rows are keyed by
    (tree, node id) packed into one int64 (node ids are below 2**31,
    ``schema.MAX_NODE_ID``) and looked up by sorting."""
    if nodes.num_rows == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    n = nodes.num_rows
    tree = pc.dictionary_encode(nodes.column("tree_id").combine_chunks()).indices
    code = np.asarray(tree.to_numpy(zero_copy_only=False), dtype=np.int64)
    node = np.asarray(nodes.column("node_id").to_numpy(), dtype=np.int64)
    parent = nodes.column("parent_id").combine_chunks()
    has_parent = np.asarray(parent.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    pid = np.asarray(pc.fill_null(parent, 0).to_numpy(), dtype=np.int64)
    parent_row = None
    if np.all(code[1:] >= code[:-1]):  # first-seen codes: each tree's rows contiguous
        start = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])[code]
        if np.array_equal(node, np.arange(n) - start):
            size = np.bincount(code)[code]
            inside = has_parent & (pid >= 0) & (pid < size)
            parent_row = np.where(inside, start + pid, -1)
    if parent_row is None:
        key = (code << 31) | node
        pkey = (code << 31) | pid
        order = np.argsort(key, kind="stable")
        pos = np.minimum(np.searchsorted(key[order], pkey), n - 1)
        parent_row = np.where(has_parent & (key[order][pos] == pkey), order[pos], -1)
    rows = np.flatnonzero(parent_row >= 0)
    by_parent = rows[np.argsort(parent_row[rows], kind="stable")]
    first = np.r_[0, np.cumsum(np.bincount(parent_row[rows], minlength=n))]
    return by_parent, first.astype(np.int64)


def _cross(index: TokenIndex, vals: list[np.ndarray], offs: list[np.ndarray],
           lens: list[np.ndarray], q: np.ndarray, partial: list[tuple[int, int, int]]
           ) -> list[tuple[int, int, int]]:
    """Follow the candidates whose prefix runs to their segment's end into the next
    segments along every path; (start row, offset, end row) of each full match."""
    kids, first = index.kids, index.first
    out: list[tuple[int, int, int]] = []
    want = q.tolist()
    for row, off, matched in partial:
        part = 0 if off < lens[0][row] else 1
        stack = [(row, part, matched)]  # continue after segment (row, part)
        while stack:
            r, p, k = stack.pop()
            nxt = [(r, 1)] if p == 0 else [(int(c), 0) for c in kids[first[r]:first[r + 1]]]
            for nr, np_ in nxt:
                lo = int(offs[np_][nr])
                take = min(int(offs[np_][nr + 1]) - lo, q.size - k)
                if take and vals[np_][lo:lo + take].tolist() != want[k:k + take]:
                    continue
                if k + take == q.size:
                    out.append((row, off, nr))
                else:
                    stack.append((nr, np_, k + take))
    return out


__all__ = ["SearchResult", "TokenIndex", "find_token_runs", "load_index", "search_regex",
           "search_tokens"]
