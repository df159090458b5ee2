"""Issue 50 items 3 and 6: no filter or query exhausts the process's memory, and ``rtrees
sql`` prints stored text with its control characters escaped.

* The filter checker (``rollout_store.sqlguard.checked_filter``) refuses the string bombs
  (``replace`` nested 7 deep, ``repeat``, ``lpad``/``rpad``, ``string_agg``, ``format``,
  ``range`` ...) and oversized or over-deep expressions, wherever a filter enters:
  ``--reuse-from`` (``check_reuse``) and the viewer's tree filter (``checked_where``);
  sane filters, ``replace`` normalisation included, still pass and run.
* Every query the process runs is bounded (``run_limited``): a bomb in free SQL (``rtrees
  sql``) ends in one line, exit 1, in a child process whose address space is capped
  (``RLIMIT_AS``), so a guard that fails shows as a crash or a wrong message here, never
  as the test machine's OOM killer. The watchdog (interrupt) and the data-segment cap are
  each tested alone.
* ``printable`` and ``rtrees sql`` in its three formats, over stored label keys holding
  a newline, NUL, ESC sequences and a bidi override.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from cli.main import app
from rollout_store import Store, connect
from rollout_store.reader import run_query
from rollout_store.schema import LABELS
from rollout_store.sqlguard import (
    FilterLimits,
    QueryLimitError,
    QueryLimits,
    UnsafeSQLError,
    checked_filter,
    parse_size,
    run_limited,
)
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.textsafe import printable, printable_table
from train.reuse import ReuseError, check_reuse

ROOT = Path(__file__).resolve().parents[1]
AS_LIMIT = 6 << 30  # the children's address space: a failed guard dies here, not the host


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "store"
    s = Store(path, create=True)
    s.append_trees(bel_shaped_batch(4, rollouts=3, depth=3, snapshot_bytes=8), key="k")
    return path


def nest(n: int, to: str, inner: str = "task_id", old: str = "a") -> str:
    """``replace`` nested ``n`` deep around ``inner``."""
    for _ in range(n):
        inner = f"replace({inner}, '{old}', '{to}')"
    return inner


# The bombs and their relatives: each passed the checker before (except where the
# function was already not allowed) and each is refused now, naming why.
BOMBS: list[tuple[str, str]] = [
    (nest(7, "a" * 20) + " = ''", "lengthens text 20 times"),
    (nest(7, "aa") + " = ''", "replace nested more than 2 deep"),
    (nest(3, "aaaa") + " = ''", "replace nested more than 2 deep"),
    ("task_id.replace('a', 'aaaaaaaaaaaaaaaaaaaa').replace('a', 'aaaaaaaaaaaaaaaaaaaa')"
     ".replace('a', 'aaaaaaaaaaaaaaaaaaaa') = ''", "lengthens text 20 times"),
    (nest(2, "a" * 64) + " = ''", "lengthens text 64 times"),
    ("replace(task_id, 'a', '" + "x" * 65 + "') = ''", "a replace literal of 65"),
    ("replace(lower(replace(upper(replace(task_id, 'a', 'aa')), 'A', 'AA')), 'a', 'aa')"
     " = ''", "replace nested more than 2 deep"),
    ("replace(task_id, 'a', meta) = ''", "must be string literals"),
    ("replace(task_id, 'a', 'aaaa' || 'aaaa' || 'aaaa') = ''", "must be string literals"),
    ("replace(task_id, 'a', replace('aaaa', 'a', 'aaaa')) = ''", "must be string literals"),
    ("replace(task_id, '', 'xxxxxxxx') = ''", "2nd argument is empty"),
    ("repeat('x', 100000000000) = ''", "'repeat' builds a value of unbounded size"),
    ("lpad(task_id, 2000000000, 'x') = ''", "'lpad' builds"),
    ("rpad(task_id, 2000000000, 'x') = ''", "'rpad' builds"),
    ("string_agg(task_id, ',') = ''", "'string_agg' builds"),
    ("format('{:>2000000000}', task_id) = ''", "'format' builds"),
    ("printf('%2000000000s', task_id) = ''", "'printf' builds"),
    ("regexp_replace(task_id, '', 'aaaa', 'g') = ''", "'regexp_replace' builds"),
    ("list_resize([task_id], 2000000000) IS NULL", "'list_resize' builds"),
    ("len(range(2000000000)) > 0", "'range' builds"),
    ("bar(1, 0, 2, 2000000000) = ''", "'bar' builds"),
    ("concat(" + ", ".join(["meta"] * 300) + ") = ''", "more than 256 expression nodes"),
    (" || ".join(["task_id"] * 300) + " = ''", "nested more than 32 deep"),  # left-deep
    ("seed IN (" + ", ".join(["1"] * 300) + ")", "more than 256 expression nodes"),
    ("NOT " * 400 + "seed = 1", "nested more than 32 deep"),
    ("+".join(["seed"] * 40) + " > 0", "nested more than 32 deep"),
    ("concat(" + ", ".join(["meta"] * 900) + ") = ''", "longer than 4000 characters"),
]
SANE = [
    "replace(task_id, '-', '_') = 'task_0'",
    "replace(task_id, 'task', 'job') LIKE 'job%'",
    nest(2, "aaaa") + " <> ''",  # the largest growth allowed: 16 times task_id
    "replace(replace(task_id, 'task-', ''), '0', 'zero') IN ('zero', '1')",
    "concat(task_id, '/', run_id) <> '' AND length(coalesce(meta, '') || env) >= 0",
    "run_id IN (" + ", ".join(f"'r{i}'" for i in range(200)) + ") OR n_nodes > 0",
    "+".join(["n_nodes"] * 20) + " > 0",
]


# ----------------------------------------------------------------- the filter checker
def test_string_bombs_are_refused_by_the_checker() -> None:
    for bomb, reason in BOMBS:
        with pytest.raises(UnsafeSQLError, match=r"is not a valid filter over trees|longer") \
                as info:
            checked_filter(bomb)
        assert reason in str(info.value), (bomb[:80], str(info.value)[-200:])
        assert len(str(info.value).splitlines()) == 1


def test_sane_filters_still_pass_and_run(store: Path) -> None:
    for ok in SANE:
        assert checked_filter(ok) == f"({ok})"
        check_reuse(Store(store), ok, "r")  # runs on the locked-down connection


def test_bombs_are_refused_where_filters_enter(store: Path) -> None:
    """``--reuse-from`` (library and a resumed run's config alike go through
    ``check_reuse``) and the viewer's tree filter (``view``, ``view --export``)."""
    from analysis.viewer.data import FilterError, ViewerData

    viewer = ViewerData(store)
    for bomb, reason in BOMBS[:12]:
        with pytest.raises(ReuseError, match="reuse_from"):
            check_reuse(Store(store), bomb, "r")
        with pytest.raises(FilterError) as info:
            viewer.trees(bomb)
        assert reason in str(info.value) or "longer" in str(info.value)
    assert [t["task_id"] for t in viewer.trees(SANE[0])["trees"]] == ["task-0"]
    assert len(viewer.trees(SANE[2])["trees"]) == 4


def test_filter_limits_are_configurable() -> None:
    deeper = nest(3, "aa") + " <> ''"
    with pytest.raises(UnsafeSQLError, match="nested more than 2 deep"):
        checked_filter(deeper)
    assert checked_filter(deeper, limits=FilterLimits(max_replace_nesting=3)) == \
        f"({deeper})"
    with pytest.raises(UnsafeSQLError, match="more than 5 expression nodes"):
        checked_filter("seed IN (1, 2, 3, 4, 5)", limits=FilterLimits(max_nodes=5))
    with pytest.raises(UnsafeSQLError, match="nested more than 2 deep"):
        checked_filter("seed + 1 > 0", limits=FilterLimits(max_depth=2))
    with pytest.raises(UnsafeSQLError, match="longer than 10 characters"):
        checked_filter("sampler = 'bel'", limits=FilterLimits(max_chars=10))
    with pytest.raises(UnsafeSQLError, match="lengthens text 2 times"):
        checked_filter("replace(task_id, 'a', 'aa') = ''",
                       limits=FilterLimits(max_replace_growth=1))
    with pytest.raises(ValueError, match="max_nodes must be >= 1"):
        FilterLimits(max_nodes=0)


# ----------------------------------------------------------------- run-time limits
def test_query_limits_sizes() -> None:
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size(" 4 gb ") == 4 * 10**9
    assert parse_size("100000") == 100000
    assert QueryLimits(rss_growth="1GB").rss_growth_bytes == 10**9
    for bad, match in (("lots", "not a size"), ("0.5MB", "at least 1MiB"),
                       ("-1GB", "not a size")):
        with pytest.raises(ValueError, match=match):
            QueryLimits(rss_growth=bad)
    with pytest.raises(ValueError, match="poll interval"):
        QueryLimits(poll_s=0)


def test_the_data_cap_holds_while_a_query_runs_and_is_restored(store: Path) -> None:
    """On Linux ``run_limited`` lowers the soft ``RLIMIT_DATA`` to the data segment plus
    twice ``rss_growth`` while it runs, and puts the old limit back after, also when the
    query fails."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_DATA is enforced on Linux only")
    before = resource.getrlimit(resource.RLIMIT_DATA)
    limits = QueryLimits(rss_growth="256MiB")
    con = connect(Store(store), restricted=True, limits=limits)

    def during() -> tuple[int, int]:
        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmData:"))
        soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
        return soft, data

    soft, data = run_limited(con, during, limits)
    assert soft != resource.RLIM_INFINITY
    assert 0 < soft - data <= 2 * 256 * 2**20
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    with pytest.raises(QueryLimitError, match=r"query exceeded 0\.3 s"):
        run_query(con, RECURSIVE, QueryLimits(timeout_s=0.3, rss_growth="256MiB"))
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


RECURSIVE = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) "
             "SELECT count(*) FROM r")


# A child process runs one query under an address-space cap and reports one line.
CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
import rollout_store.sqlguard as guard
from rollout_store import Store, connect
from rollout_store.reader import run_query
from rollout_store.sqlguard import QueryLimitError, QueryLimits

mode, store, query = sys.argv[1:4]
if mode == "watchdog-only":  # no data cap: only the interrupt can stop the query
    import contextlib
    guard._data_capped = lambda growth: contextlib.nullcontext()
limits = QueryLimits(rss_growth="256MiB", memory="8GB", timeout_s=60)
con = connect(Store(store), restricted=True, limits=limits)
run_query(con, "SELECT count(*) FROM trees", limits)
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
try:
    run_query(con, query, limits)
    print("ran")
except QueryLimitError as exc:
    rows = run_query(con, "SELECT count(*) AS n FROM trees", limits).to_pylist()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(type(exc.__cause__).__name__, rows[0]["n"], peak - start, str(exc), sep="|")
    sys.exit(1)
"""


def _limit_as() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _child(mode: str, store: Path, query: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-c", CHILD.format(limit=AS_LIMIT), mode,
                           str(store), query], capture_output=True, text=True, cwd=ROOT,
                          timeout=180)
    return proc.returncode, proc.stdout.strip(), proc.stderr


# 7 nested replaces: 10^7 characters a row, 2048 rows a vector (20 GB in one vector)
ONE_VECTOR_BOMB = (f"SELECT sum(length({nest(7, 'a' * 10, inner=chr(39) + 'xa' + chr(39))}"
                   " || i::VARCHAR)) FROM range(100000) t(i)")
# 10 kB a row, kept row after row by list(): grows vector by vector
GROWING = "SELECT length(list(repeat('x', 10000) || i::VARCHAR)) FROM range(100000000) t(i)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA: Linux")
def test_one_vector_bomb_stops_at_the_data_cap(store: Path) -> None:
    """The interrupt cannot stop one vector of a string bomb; the data cap does: the
    allocation fails inside DuckDB, the query ends with QueryLimitError, the connection
    still answers, and the child's peak resident memory stays near the bound."""
    code, out, err = _child("both", store, ONE_VECTOR_BOMB)
    assert code == 1, (code, out, err[-2000:])
    cause, n, grown_mib, message = out.split("|", 3)
    assert cause == "OutOfMemoryException"
    assert n == "4"
    assert "query exceeded the process memory limit" in message and "256MiB" in message
    assert int(grown_mib) < 2 * 256 + 128, grown_mib  # the cap, not the 6 GiB of RLIMIT_AS
    assert "Traceback" not in err


def test_the_watchdog_interrupts_a_growing_query(store: Path) -> None:
    """With the data cap switched off, the resident-memory watchdog alone stops a query
    that grows vector by vector (``con.interrupt()``)."""
    code, out, err = _child("watchdog-only", store, GROWING)
    assert code == 1, (code, out, err[-2000:])
    cause, n, grown_mib, message = out.split("|", 3)
    assert cause == "InterruptException"
    assert n == "4"
    assert "query exceeded the process memory limit" in message
    assert int(grown_mib) < 256 + 256, grown_mib  # the bound, plus a vector or two


def test_rtrees_sql_bomb_is_one_line(store: Path) -> None:
    """The issue's case: a replace bomb in free SQL, in a child whose address space is
    capped (before: no guard but the kernel's; now: one line, exit 1, not killed)."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", "sql", ONE_VECTOR_BOMB,
                           "--store", str(store), "--rss-growth", "256MiB"],
                          capture_output=True, text=True, cwd=ROOT, preexec_fn=_limit_as,
                          timeout=180)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: query exceeded the process "
                                                   "memory limit"), proc.stderr[-2000:]
    assert "--rss-growth" in lines[0] and proc.stdout == ""


def test_rtrees_sql_refuses_a_bad_rss_growth(store: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        app(["sql", "SELECT 1", "--store", str(store), "--rss-growth", "lots"])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "process memory limit" in err[0] and "not a size" in err[0]


# ----------------------------------------------------------------- printable text
NASTY = ["line1\nforged row", "nul\x00hidden", "\x1b[2J\x1b[H cleared",
         "\x1b]0;pwned title\x07", "tab\there\r\x7f", "rtl\u202eexe.txt", "\x9b31m c1"]


def test_printable_escapes_control_characters_only() -> None:
    assert printable("a\nb") == "a\\nb"
    assert printable("\x1b[2J") == "\\x1b[2J"
    assert printable("x\x00y\x07\x7f\x9b") == "x\\x00y\\x07\\x7f\\x9b"
    assert printable("evil\u202etxt.exe\u2028") == "evil\\u202etxt.exe\\u2028"
    assert printable("bad\udcff") == "bad\\udcff"  # a lone surrogate would not encode
    kept = "café 東京 🙂 a\u00a0b \\n [red]"
    assert printable(kept) == kept
    assert printable("a\nb\x1b", newlines=True) == "a\nb\\x1b"
    for text in NASTY:  # no quote or backslash in them: exactly repr's escapes
        assert printable(text) == repr(text)[1:-1]
        assert printable(text).isprintable()


def test_printable_table_escapes_values_and_names() -> None:
    table = pa.table({"k\x1b": ["a\nb", None], "n": [1, 2], "b": [b"\x1b[2J", None],
                      "l": [["\x07"], []]})
    shown = printable_table(table)
    assert shown.column_names == ["k\\x1b", "n", "b", "l"]
    assert shown.column("k\\x1b").to_pylist() == ["a\\nb", None]
    assert shown.column("n").to_pylist() == [1, 2]
    assert shown.column("b").to_pylist() == ["b'\\x1b[2J'", None]
    assert shown.column("l").to_pylist() == ['["\\u0007"]', "[]"]


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    """A store whose ``labels`` hold keys and values with control characters (written as
    rows, as an old or foreign writer could have)."""
    s = Store(tmp_path / "store", create=True)
    s.append_trees(bel_shaped_batch(2, rollouts=2, depth=2, snapshot_bytes=8), key="k")
    tree_id = connect(s).execute("SELECT min(tree_id) FROM trees").fetchall()[0][0]
    rows = [{"tree_id": tree_id, "node_id": None, "key": text, "value": text,
             "author": "t", "created_at": pa.scalar(0, pa.timestamp("us", "UTC")).as_py()}
            for text in NASTY]
    s.append_labels(pa.Table.from_pylist(rows, schema=LABELS))
    return tmp_path / "store"


def _sql(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        app(args)
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def _assert_no_raw_controls(out: str) -> None:
    raw = [c for c in out if c != "\n" and printable(c) != c]
    assert not raw, f"raw control characters printed: {raw!r}"


def test_rtrees_sql_escapes_stored_text_in_every_format(
        labelled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sql", "SELECT key, value AS \"v\x1b[0m\" FROM labels ORDER BY key", "--store",
            str(labelled)]
    table = _sql(base, capsys)
    _assert_no_raw_controls(table)
    for shown in ("line1\\nforged", "nul\\x00hidden", "\\x1b[2J\\x1b[H", "\\x1b]0;pwned",
                  "rtl\\u202eexe", "v\\x1b[0m"):
        assert shown in table, shown
    assert table.count("forged row") == 2  # key and value, each on the line of its row
    csv = _sql([*base, "--format", "csv"], capsys)
    _assert_no_raw_controls(csv)
    assert len(csv.strip().splitlines()) == 1 + len(NASTY)  # no value broke a line
    assert '"line1\\nforged row"' in csv and '"v\\x1b[0m"' in csv
    out = _sql([*base, "--format", "json"], capsys)
    _assert_no_raw_controls(out)
    assert sorted(r["key"] for r in json.loads(out)) == sorted(NASTY)  # exact values
