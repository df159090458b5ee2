"""Text from users and files that reaches DuckDB: checked filters, locked-down
connections, and limits on time, memory and temporary disk (issue 21).

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
  ``run_limited`` runs a query under a wall-clock limit (``con.interrupt()`` from a
  timer); a query past a limit raises ``QueryLimitError``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_store.errors import StoreError

if TYPE_CHECKING:
    import duckdb

T = TypeVar("T")

MAX_FILTER_CHARS = 4_000

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
    """A query ran past a limit of its connection: wall-clock time, memory or temporary
    disk (``QueryLimits``)."""


@dataclass(frozen=True)
class QueryLimits:
    """Limits of a locked-down connection (``lock_down``) and its queries (``run_limited``).

    ``memory`` and ``temp_disk`` are DuckDB sizes (``"2GB"``, ``"512MB"``). ``temp_disk``
    caps spilling into ``temp_directory``; without a ``temp_directory`` nothing spills
    (a query that needs more than ``memory`` fails with ``QueryLimitError``) and nothing is
    written anywhere (DuckDB's default would be ``./.tmp``)."""

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

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"query timeout must be > 0 seconds, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"query threads must be >= 1, got {self.threads}")


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
                timeout_s: float, memory: str | None = None) -> T:
    """``run()`` (a query on ``con``, fetched inside it) under a wall-clock limit: past
    ``timeout_s`` seconds ``con.interrupt()`` stops it and ``QueryLimitError`` says so; a
    query out of memory or temporary disk raises ``QueryLimitError`` too (``memory``
    names the limit in the message)."""
    import duckdb

    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def stop() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                con.interrupt()

    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    try:
        return run()
    except duckdb.InterruptException as exc:
        if state["fired"]:
            raise QueryLimitError(f"query exceeded {timeout_s:g} s (the time limit; "
                                  "see --timeout)") from exc
        raise
    except duckdb.OutOfMemoryException as exc:
        what = ("the temporary disk limit" if "max_temp_directory_size" in str(exc)
                else f"the memory limit{f' of {memory}' if memory else ''}")
        raise QueryLimitError(f"query exceeded {what} (see --memory and --temp-disk): "
                              f"{str(exc).splitlines()[0]}") from exc
    finally:
        with lock:
            state["done"] = True
        timer.cancel()


def checked_filter(text: str, columns: Sequence[str] | None = None, *,
                   what: str = "filter") -> str:
    """``text`` as a parenthesised boolean expression over the ``trees`` view, safe to put
    after ``WHERE`` or ``AND``; ``UnsafeSQLError`` (naming ``what``) for anything else
    (module docstring). ``columns``: the names it may use (default: the ``trees``
    schema's)."""
    import duckdb

    from rollout_store.schema import SCHEMAS

    if not isinstance(text, str):
        raise UnsafeSQLError(f"{what} must be a string, got {type(text).__name__}")
    body = text.strip()
    if not body:
        raise UnsafeSQLError(f"{what} is empty")
    if len(body) > MAX_FILTER_CHARS:
        raise UnsafeSQLError(f"{what} is longer than {MAX_FILTER_CHARS} characters")
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
    _check_expression(node["where_clause"], names, body, what)
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


def _check_expression(expr: Any, columns: set[str], body: str, what: str) -> None:
    """Walk every node below the WHERE clause (``_EXPRESSION_CLASSES`` only)."""
    if isinstance(expr, list):
        for item in expr:
            _check_expression(item, columns, body, what)
        return
    if not isinstance(expr, dict):
        return
    cls = expr.get("class")
    if cls is not None:
        kind = str(expr.get("type", ""))
        if cls == "SUBQUERY":
            raise _refused(what, body, "a subquery (a filter reads the columns of trees "
                           "only)")
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
            allowed = FILTER_OPERATORS if expr.get("is_operator") else FILTER_FUNCTIONS
            if (expr.get("schema") or expr.get("catalog") or name not in allowed
                    or expr.get("filter") is not None or expr.get("distinct")
                    or (expr.get("order_bys") or {}).get("orders")
                    or expr.get("export_state")):
                raise _refused(what, body, f"function {name!r} (scalar functions of the "
                               "columns only: no table function, file access, aggregate "
                               "or setting)")
    for value in expr.values():
        if isinstance(value, dict | list):
            _check_expression(value, columns, body, what)


def _refused(what: str, body: str, reason: str) -> UnsafeSQLError:
    return UnsafeSQLError(f"{what} {body!r} is not a valid filter over trees: {reason}")


def _literal(text: str) -> str:
    """A SQL string literal of ``text`` (for SET, which takes no parameters)."""
    return "'" + str(text).replace("'", "''") + "'"


__all__ = ["FILTER_FUNCTIONS", "FILTER_OPERATORS", "FILTER_TYPES", "QueryLimitError",
           "QueryLimits", "UnsafeSQLError", "checked_filter", "lock_down", "run_limited"]
