"""Text from users and files that reaches DuckDB: checked filters, locked-down
connections, and limits on time, memory and temporary disk (issues 21 and 50).

Three rules hold wherever such text meets SQL:

* **A filter is one boolean expression over the ``trees`` view**, never SQL text pasted
  into a statement. ``checked_filter(text)`` parses ``SELECT 1 FROM trees WHERE (text)``
  with DuckDB's own parser (``json_serialize_sql``) and accepts it only if the statement
  is exactly that shape (one statement, no ``;``, no comment, balanced parentheses, no
  set operation, CTE, ORDER BY or GROUP BY smuggled in) and every node of the expression
  is a column of ``trees``, a constant, an operator, a cast, a CASE, or a scalar function
  of ``FILTER_FUNCTIONS`` (string, number, JSON, map and date functions: no table
  function such as ``read_text`` / ``read_csv`` / ``read_parquet`` / ``glob``, no
  ``getenv``, no subquery, no aggregate or window). Anything else raises
  ``UnsafeSQLError`` naming what was refused. ``TrainConfig.reuse_from`` is such a
  filter (``train.reuse``).
* **Values are parameters**: a value read from a file or an option is bound
  (``con.execute(query, [value])`` or ``{"name": value}``), never formatted into SQL.
* **A connection that runs text it did not write is locked down** (``lock_down``):
  external access off except the files it must read (``allowed_paths``), a bounded
  ``memory_limit`` and thread count, no spilling to disk unless a private temporary
  directory with a size cap is given, and the configuration locked so no query can undo
  any of it. ``rollout_store.reader.connect(restricted=True)`` (``rtrees sql``, reuse
  filters) and the study reports (``analysis.report.study_connection``) use it.
  ``run_limited`` runs a query under a wall-clock limit and a process memory limit
  (below); a query past a limit raises ``QueryLimitError``, one line.

**No filter and no query exhausts the process's memory** (issue 50). DuckDB's
``memory_limit`` bounds its buffer manager (sorts, hash tables, spilled pages), not the
strings an expression builds: ``replace`` nested 7 deep with a 20-character replacement
turns a 6-character ``task_id`` into 1.3 GB per row, 2048 rows a vector, and the kernel
killed the viewer's server, ``view --export``, ``train --reuse-from`` and ``rtrees sql``
in 4-16 s. Two layers bound it:

* **The checker bounds what a filter can build** (``FilterLimits``, defaults in
  brackets). The text is at most ``max_chars`` [4000] characters, its expression at most
  ``max_nodes`` [256] nodes and ``max_depth`` [32] nested nodes: a hand-written filter
  is a few dozen nodes and 3-6 deep, a generated ``run_id IN (...)`` list is one node per
  value (up to about 250 values), a chain ``a || b || c ...`` or ``a + b + c ...`` is one
  level per operator (up to about 30 terms; ``AND`` / ``OR`` chains are flat), and the
  walk is iterative, so no depth reaches Python's recursion limit.
  With those bounds every allowed function but ``replace`` builds at most a sum of its
  arguments (``concat``, ``||``, ``list_value``: linear in the expression's size), or a
  value no longer than its format (``strftime``). ``replace(s, from, to)`` multiplies: its
  output is at most ``ceil(len(to) / len(from))`` times ``s``, and nested ``n`` deep that
  factor is raised to the ``n``-th power. So ``from`` and ``to`` must be string literals
  (a column or an expression there is a factor of unknown size), ``from`` non-empty, both
  at most ``max_replace_literal`` [64] characters, each call's factor at most
  ``max_replace_growth`` [4] and at most ``max_replace_nesting`` [2] calls on one path
  of the expression: a filter's ``replace`` normalises text (``'-'`` to ``'_'``, a word to
  another), and 4 x 4 = 16 times a column is the most any filter builds. Functions that
  build a value of unbounded size from a small one (``GROWING_FUNCTIONS``: ``repeat``,
  ``lpad``, ``rpad``, ``string_agg``, ``range``, ``list_resize`` ...) are refused by
  name, as are aggregates, windows and subqueries.
* **The process bounds every query it runs** (``run_limited``, ``QueryLimits.rss_growth``,
  default 4GB), free SQL included (``rtrees sql --rss-growth``): a watchdog thread reads
  the process's resident set (psutil) every ``poll_s`` seconds and interrupts
  the query once it has grown by more than ``rss_growth``. DuckDB looks at an interrupt
  only between vectors, and one vector of a string bomb is computed whole (2048 rows of
  it), so on Linux the process's data segment is also capped (``RLIMIT_DATA``) at twice
  ``rss_growth`` above its size when the query starts, for as long as the query (or any
  other query of the process that overlaps it) runs: an allocation past the cap fails
  inside DuckDB, which raises ``OutOfMemoryException``, instead of the kernel killing the
  process. Either way the query ends with ``QueryLimitError`` ("query exceeded the
  process memory limit ..."), and the connection stays usable. The cap is the process's:
  another thread that allocates past it while the query runs gets a ``MemoryError``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_store.errors import StoreError

if TYPE_CHECKING:
    import duckdb

T = TypeVar("T")


@dataclass(frozen=True)
class FilterLimits:
    """What a checked filter may be and build (``checked_filter``; the module docstring
    says why each default is what it is)."""

    max_chars: int = 4_000
    """Characters of the filter text."""
    max_nodes: int = 256
    """Nodes of its expression (columns, constants, operators, functions, casts)."""
    max_depth: int = 32
    """Nodes on the longest path from the expression's root to a leaf."""
    max_replace_nesting: int = 2
    """``replace`` calls on one path of the expression (``replace(replace(x, ..), ..)``)."""
    max_replace_literal: int = 64
    """Characters of ``replace``'s ``from`` and ``to`` literals."""
    max_replace_growth: int = 4
    """``ceil(len(to) / len(from))``: how many times one ``replace`` may lengthen text."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_nodes", "max_depth", "max_replace_literal",
                     "max_replace_growth"):
            if getattr(self, name) < 1:
                raise ValueError(f"filter limit {name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.max_replace_nesting < 0:
            raise ValueError("filter limit max_replace_nesting must be >= 0, got "
                             f"{self.max_replace_nesting}")


MAX_FILTER_CHARS = FilterLimits().max_chars

# Scalar functions a filter may call: pure functions of their arguments (no file, no
# environment, no settings, no table functions; none that builds a value of unbounded size
# from a small one, such as repeat or range).
FILTER_FUNCTIONS: frozenset[str] = frozenset({
    # numbers
    "abs", "ceil", "ceiling", "floor", "round", "trunc", "sign", "sqrt", "cbrt", "exp",
    "ln", "log", "log2", "log10", "pow", "power", "mod", "greatest", "least", "isnan",
    "isinf", "isfinite",
    # strings
    "lower", "upper", "lcase", "ucase", "length", "len", "strlen", "char_length",
    "character_length", "starts_with", "ends_with", "prefix", "suffix", "contains",
    "instr", "position", "strpos", "substring", "substr", "left", "right", "trim",
    "ltrim", "rtrim", "replace", "concat", "concat_ws", "split_part", "regexp_matches",
    "regexp_full_match", "regexp_extract", "like_escape", "ilike_escape", "nullif",
    "ifnull", "coalesce", "if", "iff",
    # JSON (meta, env_config)
    "json_extract", "json_extract_string", "json_extract_path",
    "json_extract_path_text", "json_exists", "json_value", "json_type", "json_valid",
    "json_array_length", "json_contains",
    # maps and lists (rollouts_by_phase, list literals)
    "map_extract", "map_extract_value", "element_at", "map_contains", "map_keys",
    "map_values", "cardinality", "list_value", "list_contains", "list_has",
    "array_contains", "array_has", "list_extract", "list_element", "array_extract",
    "array_length", "list_has_any", "list_has_all",
    # dates (created_at)
    "date_part", "datepart", "date_trunc", "datetrunc", "epoch", "epoch_ms", "year",
    "month", "day", "hour", "minute", "second", "strftime", "make_date", "to_timestamp",
    "now", "current_timestamp", "today", "current_date",
})
# Functions that build a value of unbounded size from small arguments (a count, a width, a
# row set): none is in FILTER_FUNCTIONS; a filter naming one is refused with this reason.
GROWING_FUNCTIONS: frozenset[str] = frozenset({
    "repeat", "lpad", "rpad", "format", "printf", "bar",  # a count or a width
    "regexp_replace",  # an empty match between every two characters: like replace
    "string_agg", "group_concat", "listagg", "list", "array_agg", "histogram",  # rows
    "range", "generate_series", "unnest", "repeat_row", "list_resize", "array_resize",
})
# Operators are FUNCTION nodes named by their symbol.
FILTER_OPERATORS: frozenset[str] = frozenset({
    "+", "-", "*", "/", "//", "%", "^", "**", "||", "~~", "!~~", "~~*", "!~~*", "~~~",
    "!~~~", "->", "->>", "@>", "<@", "&&", "=", "<>", "!=", "<", ">", "<=", ">=",
})
# Types a filter may cast to (a ``TYPE 'literal'`` constant is a cast too: without this
# list ``ATTACH '/tmp/x.db'`` would parse as a cast to a type named ATTACH).
FILTER_TYPES: frozenset[str] = frozenset({
    "boolean", "bool", "tinyint", "smallint", "integer", "int", "int2", "int4", "int8",
    "bigint", "hugeint", "utinyint", "usmallint", "uinteger", "ubigint", "float", "float4",
    "float8", "real", "double", "decimal", "numeric", "varchar", "text", "string", "char",
    "date", "time", "timestamp", "timestamptz", "timestamp with time zone", "interval",
    "list", "struct", "map", "json", "uuid",
})
_EXPRESSION_CLASSES = frozenset({"CONJUNCTION", "COMPARISON", "CONSTANT", "COLUMN_REF",
                                 "OPERATOR", "FUNCTION", "BETWEEN", "CAST", "CASE",
                                 "TYPE", "COLLATE"})
_OPERATOR_TYPES = frozenset({"COMPARE_IN", "COMPARE_NOT_IN", "OPERATOR_NOT",
                             "OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL", "ARRAY_EXTRACT",
                             "ARRAY_SLICE", "STRUCT_EXTRACT", "OPERATOR_COALESCE",
                             "OPERATOR_NULLIF", "ARRAY_CONSTRUCTOR"})


class UnsafeSQLError(ValueError):
    """Text refused before it reaches DuckDB: a filter that is not one boolean expression
    over ``trees`` (``checked_filter``), or a statement that is not read-only."""


class QueryLimitError(StoreError):
    """A query ran past a limit of its connection or process: wall-clock time, memory,
    temporary disk or the process's memory growth (``QueryLimits``)."""


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes of a size as DuckDB writes them: ``"512MB"``, ``"4GB"`` (powers of 1000),
    ``"1.5GiB"`` (powers of 1024), ``"100000"`` (bytes); ``ValueError`` otherwise."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 512MB, 4GB, 1GiB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class QueryLimits:
    """Limits of a locked-down connection (``lock_down``) and its queries (``run_limited``).

    ``memory``, ``temp_disk`` and ``rss_growth`` are DuckDB sizes (``"2GB"``, ``"512MB"``).
    ``temp_disk`` caps spilling into ``temp_directory``; without a ``temp_directory``
    nothing spills (a query that needs more than ``memory`` fails with
    ``QueryLimitError``) and nothing is written anywhere (DuckDB's default would be
    ``./.tmp``). ``memory`` bounds DuckDB's buffer manager only; ``rss_growth`` bounds the
    whole process while a query runs, strings an expression builds included (module
    docstring)."""

    timeout_s: float = 60.0
    """Wall-clock limit of one query, seconds."""
    memory: str = "2GB"
    """DuckDB ``memory_limit``."""
    threads: int = 4
    """DuckDB ``threads``."""
    temp_directory: str | None = None
    """A private directory DuckDB may spill into (the caller creates and removes it); None:
    no spilling."""
    temp_disk: str = "1GB"
    """DuckDB ``max_temp_directory_size`` (with ``temp_directory`` only)."""
    rss_growth: str = "4GB"
    """How much the process's resident memory may grow while one query runs: past it the
    query is interrupted (and on Linux an allocation past twice it above the data segment
    fails inside DuckDB): ``QueryLimitError``."""
    poll_s: float = 0.02
    """How often the watchdog reads the process's resident memory and the clock, seconds."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"query timeout must be > 0 seconds, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"query threads must be >= 1, got {self.threads}")
        try:
            growth = parse_size(self.rss_growth)
        except ValueError as exc:
            raise ValueError(f"bad process memory limit (rss_growth): {exc}") from None
        if growth < 1 << 20:
            raise ValueError(f"process memory limit (rss_growth) must be at least 1MiB, "
                             f"got {self.rss_growth!r}")
        if not 0 < self.poll_s <= 1:
            raise ValueError(f"watchdog poll interval must be in (0, 1] s, got {self.poll_s}")

    @property
    def rss_growth_bytes(self) -> int:
        """``rss_growth`` in bytes."""
        return parse_size(self.rss_growth)


def lock_down(con: duckdb.DuckDBPyConnection, allowed_paths: Iterable[str] = (),
              limits: QueryLimits | None = None) -> duckdb.DuckDBPyConnection:
    """Lock ``con`` for text it did not write (module docstring): only ``allowed_paths``
    readable, ``limits`` set, configuration locked (a later ``SET`` fails). Call it after
    every view and registration the connection needs."""
    limits = limits or QueryLimits()
    paths = list(allowed_paths)
    try:
        con.execute(f"SET memory_limit = {_literal(limits.memory)}")
        con.execute(f"SET max_memory = {_literal(limits.memory)}")
    except Exception as exc:  # duckdb's own error classes; the size text came from a user
        raise ValueError(f"bad memory limit {limits.memory!r}: "
                         f"{str(exc).splitlines()[0]}") from exc
    con.execute(f"SET threads = {int(limits.threads)}")
    if limits.temp_directory is None:
        con.execute("SET temp_directory = ''")
    else:
        con.execute(f"SET temp_directory = {_literal(limits.temp_directory)}")
        try:
            con.execute(f"SET max_temp_directory_size = {_literal(limits.temp_disk)}")
        except Exception as exc:
            raise ValueError(f"bad temporary disk limit {limits.temp_disk!r}: "
                             f"{str(exc).splitlines()[0]}") from exc
    if paths:
        con.execute("SET allowed_paths = [" + ", ".join(_literal(p) for p in paths) + "]")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET lock_configuration = true")
    return con


def run_limited(con: duckdb.DuckDBPyConnection, run: Callable[[], T],
                limits: QueryLimits | None = None) -> T:
    """``run()`` (a query on ``con``, fetched inside it) within ``limits`` (default
    ``QueryLimits()``): a watchdog thread interrupts it (``con.interrupt()``) past ``timeout_s``
    seconds or once the process's resident memory has grown by more than ``rss_growth``,
    and on Linux the process's data segment is capped for as long as it runs (module
    docstring). Past any limit, or past the connection's memory or temporary-disk limit,
    ``QueryLimitError`` says which, in one line."""
    import duckdb
    import psutil

    limits = limits or QueryLimits()
    growth = limits.rss_growth_bytes
    lock = threading.Lock()
    state: dict[str, str | None] = {"fired": None}
    done = threading.Event()
    process = psutil.Process()
    base = process.memory_info().rss
    start = time.monotonic()

    def stop(why: str) -> None:
        with lock:
            if not done.is_set():
                state["fired"] = why
                con.interrupt()

    def watch() -> None:
        while True:
            left = limits.timeout_s - (time.monotonic() - start)
            if left <= 0:
                stop("time")
                return
            if process.memory_info().rss - base > growth:
                stop("memory")
                return
            if done.wait(min(limits.poll_s, left)):
                return

    with _data_capped(2 * growth):
        watchdog = threading.Thread(target=watch, name="query-watchdog", daemon=True)
        watchdog.start()
        try:
            return run()
        except duckdb.InterruptException as exc:
            if state["fired"] == "time":
                raise QueryLimitError(f"query exceeded {limits.timeout_s:g} s (the time "
                                      "limit; see --timeout)") from exc
            if state["fired"] == "memory":
                raise QueryLimitError(_grew(limits)) from exc
            raise
        except duckdb.OutOfMemoryException as exc:
            text = str(exc)
            if "bad allocation" in text or "Allocation failure" in text:
                raise QueryLimitError(_grew(limits)) from exc  # the data cap, or the host
            what = ("the temporary disk limit" if "max_temp_directory_size" in text
                    else f"the memory limit of {limits.memory}")
            raise QueryLimitError(f"query exceeded {what} (see --memory and --temp-disk): "
                                  f"{text.splitlines()[0]}") from exc
        except MemoryError as exc:  # pyarrow or Python fetching the result under the cap
            raise QueryLimitError(_grew(limits)) from exc
        finally:
            with lock:
                done.set()
            watchdog.join()


def _grew(limits: QueryLimits) -> str:
    return (f"query exceeded the process memory limit: it grew this process's memory by "
            f"more than {limits.rss_growth} (strings and lists an expression builds are "
            "outside DuckDB's --memory; see --rss-growth)")


_CAP_LOCK = threading.Lock()
_cap: dict[str, Any] = {"users": 0, "saved": None}


def _data_size() -> int | None:
    """The process's data segment (``VmData``: what ``RLIMIT_DATA`` counts), bytes; None
    where there is no ``/proc``."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextmanager
def _data_capped(growth: int) -> Iterator[None]:
    """On Linux, cap the process's data segment (``RLIMIT_DATA``, soft limit) at its size
    now plus ``growth`` while the block runs; overlapping blocks (queries of several
    threads) share the first one's cap, and the last to leave restores the old limit. A
    limit that is already lower is kept; elsewhere this does nothing."""
    if not sys.platform.startswith("linux"):
        yield
        return
    import resource

    with _CAP_LOCK:
        if _cap["users"] == 0:
            size = _data_size()
            try:
                soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
                if size is not None:
                    cap = size + growth
                    if hard != resource.RLIM_INFINITY:
                        cap = min(cap, hard)
                    if soft == resource.RLIM_INFINITY or cap < soft:
                        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
                        _cap["saved"] = (soft, hard)
            except (OSError, ValueError):
                _cap["saved"] = None  # the watchdog still bounds the query
        _cap["users"] += 1
    try:
        yield
    finally:
        with _CAP_LOCK:
            _cap["users"] -= 1
            if _cap["users"] == 0 and _cap["saved"] is not None:
                resource.setrlimit(resource.RLIMIT_DATA, _cap["saved"])
                _cap["saved"] = None


def checked_filter(text: str, columns: Sequence[str] | None = None, *,
                   what: str = "filter", limits: FilterLimits | None = None) -> str:
    """``text`` as a parenthesised boolean expression over the ``trees`` view, safe to put
    after ``WHERE`` or ``AND``, of bounded size and bounded string growth (``limits``,
    default ``FilterLimits()``); ``UnsafeSQLError`` (naming ``what``) for anything else
    (module docstring). ``columns``: the names it may use (default: the ``trees``
    schema's)."""
    import duckdb

    from rollout_store.schema import SCHEMAS

    if not isinstance(text, str):
        raise UnsafeSQLError(f"{what} must be a string, got {type(text).__name__}")
    body = text.strip()
    if not body:
        raise UnsafeSQLError(f"{what} is empty")
    limits = limits or FilterLimits()
    if len(body) > limits.max_chars:
        raise UnsafeSQLError(f"{what} is longer than {limits.max_chars} characters")
    if "\x00" in body:
        raise UnsafeSQLError(f"{what} holds a NUL character")
    names = {c.lower() for c in (columns if columns is not None else SCHEMAS["trees"].names)}
    try:
        tokens = duckdb.tokenize(body)
    except Exception as exc:
        raise _refused(what, body, f"cannot be read as SQL: {str(exc).splitlines()[0]}"
                       ) from exc
    depth = 0
    for i, (pos, kind) in enumerate(tokens):
        end = tokens[i + 1][0] if i + 1 < len(tokens) else len(body)
        token = body[pos:end].strip()
        if kind == duckdb.token_type.comment:
            raise _refused(what, body, "a comment")
        if kind == duckdb.token_type.operator:
            depth += token.count("(") - token.count(")")
            if ";" in token:
                raise _refused(what, body, "';' (one expression, not statements)")
            if depth < 0:
                raise _refused(what, body, "unbalanced parentheses")
    if depth != 0:
        raise _refused(what, body, "unbalanced parentheses")
    wrapped = f"SELECT 1 FROM trees WHERE ({body})"
    parser = duckdb.connect()
    try:
        n = len(duckdb.extract_statements(wrapped))
        doc = json.loads(parser.execute("SELECT json_serialize_sql(?)", [wrapped]
                                        ).fetchall()[0][0])
    except Exception as exc:  # duckdb's parser errors
        raise _refused(what, body, "not a valid SQL expression: "
                       f"{str(exc).splitlines()[0]}") from exc
    finally:
        parser.close()
    if doc.get("error"):
        raise _refused(what, body, "not a valid SQL expression: "
                       f"{doc.get('error_message', 'parse error')}")
    statements = doc.get("statements", [])
    if n != 1 or len(statements) != 1:
        raise _refused(what, body, f"one expression, not {n} statements")
    node = statements[0].get("node", {})
    _check_shape(node, body, what)
    _check_expression(node["where_clause"], names, body, what, limits)
    return f"({body})"


def _check_shape(node: dict[str, Any], body: str, what: str) -> None:
    """The parsed wrapper must be exactly ``SELECT 1 FROM trees WHERE (...)``: anything
    else means the text closed the expression and went on (a set operation, a CTE, an
    ORDER BY / GROUP BY / LIMIT, another FROM item)."""
    table = node.get("from_table") or {}
    select = node.get("select_list") or []
    ok = (node.get("type") == "SELECT_NODE" and not node.get("modifiers")
          and not (node.get("cte_map") or {}).get("map")
          and not node.get("group_expressions") and not node.get("group_sets")
          and node.get("having") is None and node.get("qualify") is None
          and node.get("sample") is None
          and table.get("type") == "BASE_TABLE" and table.get("table_name") == "trees"
          and not table.get("schema_name") and not table.get("catalog_name")
          and table.get("at_clause") is None and table.get("sample") is None
          and len(select) == 1 and select[0].get("class") == "CONSTANT"
          and node.get("where_clause") is not None)
    if not ok:
        raise _refused(what, body, "not a single boolean expression (it reaches past "
                       "its WHERE clause)")


def _check_expression(root: Any, columns: set[str], body: str, what: str,
                      limits: FilterLimits) -> None:
    """Walk every node below the WHERE clause (``_EXPRESSION_CLASSES`` only), counting
    nodes, depth and nested ``replace`` calls (``limits``). Iterative: a deep expression
    cannot reach Python's recursion limit."""
    nodes = 0
    stack: list[tuple[Any, int, int]] = [(root, 0, 0)]  # (item, depth, replace calls above)
    while stack:
        expr, depth, replaces = stack.pop()
        if isinstance(expr, list):
            stack.extend((item, depth, replaces) for item in expr)
            continue
        if not isinstance(expr, dict):
            continue
        cls = expr.get("class")
        if cls is not None:
            depth += 1
            nodes += 1
            if nodes > limits.max_nodes:
                raise _refused(what, body, f"more than {limits.max_nodes} expression "
                               "nodes (the filter size limit)")
            if depth > limits.max_depth:
                raise _refused(what, body, f"nested more than {limits.max_depth} deep (the "
                               "filter depth limit)")
            _check_node(expr, str(cls), columns, body, what)
            if cls == "FUNCTION" and not expr.get("is_operator") \
                    and str(expr.get("function_name", "")).lower() == "replace":
                replaces += 1
                _check_replace(expr, replaces, body, what, limits)
        stack.extend((value, depth, replaces) for value in expr.values()
                     if isinstance(value, dict | list))


def _check_node(expr: dict[str, Any], cls: str, columns: set[str], body: str,
                what: str) -> None:
    """One expression node: its class, and the column, type or function it names."""
    kind = str(expr.get("type", ""))
    if cls == "SUBQUERY":
        raise _refused(what, body, "a subquery (a filter reads the columns of trees only)")
    if cls not in _EXPRESSION_CLASSES:
        raise _refused(what, body, f"a {cls.lower()} expression")
    if cls == "OPERATOR" and kind not in _OPERATOR_TYPES:
        raise _refused(what, body, f"operator {kind}")
    if cls == "COLUMN_REF":
        parts = [str(p).lower() for p in expr.get("column_names", [])]
        if parts[:1] == ["trees"] and len(parts) == 2:
            parts = parts[1:]
        if len(parts) != 1 or parts[0] not in columns:
            raise _refused(what, body, f"{'.'.join(parts)!r} is not a column of "
                           f"trees (columns: {', '.join(sorted(columns))})")
    if cls == "TYPE":
        name = str(expr.get("type_name", "")).lower()
        if expr.get("schema") or expr.get("catalog") or name not in FILTER_TYPES:
            raise _refused(what, body, f"type {name!r} (types: "
                           f"{', '.join(sorted(FILTER_TYPES))})")
    if cls == "FUNCTION":
        name = str(expr.get("function_name", "")).lower()
        if not expr.get("is_operator") and name in GROWING_FUNCTIONS:
            raise _refused(what, body, f"function {name!r} builds a value of unbounded "
                           "size from small arguments (the filter memory bound)")
        allowed = FILTER_OPERATORS if expr.get("is_operator") else FILTER_FUNCTIONS
        if (expr.get("schema") or expr.get("catalog") or name not in allowed
                or expr.get("filter") is not None or expr.get("distinct")
                or (expr.get("order_bys") or {}).get("orders")
                or expr.get("export_state")):
            raise _refused(what, body, f"function {name!r} (scalar functions of the "
                           "columns only: no table function, file access, aggregate "
                           "or setting)")


def _arguments(expr: dict[str, Any]) -> list[Any]:
    """A FUNCTION node's argument expressions (DuckDB 2 serialises ``arguments`` as
    ``{name, expression}`` items; older versions as ``children``)."""
    if "arguments" in expr:
        return [a.get("expression") if isinstance(a, dict) and "expression" in a else a
                for a in expr.get("arguments") or []]
    return list(expr.get("children") or [])


def _string_literal(expr: Any) -> str | None:
    """The text of a string constant node, else None."""
    if not isinstance(expr, dict) or expr.get("class") != "CONSTANT":
        return None
    literal = expr.get("literal")
    if isinstance(literal, dict):
        return str(literal.get("text", "")) if literal.get("kind") == "STRING" else None
    value = expr.get("value")  # older serialisation: {"type": {"id": ...}, "value": ...}
    if isinstance(value, dict) and (value.get("type") or {}).get("id") == "VARCHAR" \
            and not value.get("is_null") and isinstance(value.get("value"), str):
        return str(value["value"])
    return None


def _check_replace(expr: dict[str, Any], replaces: int, body: str, what: str,
                   limits: FilterLimits) -> None:
    """``replace(s, from, to)`` within ``limits``: literal ``from`` and ``to``, bounded
    growth per call and bounded nesting (module docstring)."""
    if replaces > limits.max_replace_nesting:
        raise _refused(what, body, f"replace nested more than {limits.max_replace_nesting} "
                       "deep (each call can lengthen text several times: the filter "
                       "memory bound)")
    args = _arguments(expr)
    if len(args) != 3:
        return  # DuckDB reports the wrong number of arguments itself
    old, new = _string_literal(args[1]), _string_literal(args[2])
    if old is None or new is None:
        raise _refused(what, body, "replace's 2nd and 3rd arguments must be string "
                       "literals (the filter memory bound)")
    if not old:
        raise _refused(what, body, "replace's 2nd argument is empty")
    longest = max(len(old), len(new))
    if longest > limits.max_replace_literal:
        raise _refused(what, body, f"a replace literal of {longest} characters (at most "
                       f"{limits.max_replace_literal}: the filter memory bound)")
    growth = math.ceil(len(new) / len(old))
    if growth > limits.max_replace_growth:
        raise _refused(what, body, f"replace({old!r}, {new!r}) lengthens text {growth} "
                       f"times (at most {limits.max_replace_growth}: the filter memory "
                       "bound)")


def _refused(what: str, body: str, reason: str) -> UnsafeSQLError:
    return UnsafeSQLError(f"{what} {body!r} is not a valid filter over trees: {reason}")


def _literal(text: str) -> str:
    """A SQL string literal of ``text`` (for SET, which takes no parameters)."""
    return "'" + str(text).replace("'", "''") + "'"


__all__ = ["FILTER_FUNCTIONS", "FILTER_OPERATORS", "FILTER_TYPES", "GROWING_FUNCTIONS",
           "FilterLimits", "QueryLimitError", "QueryLimits", "UnsafeSQLError",
           "checked_filter", "lock_down", "parse_size", "run_limited"]
