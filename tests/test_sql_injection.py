"""Issue 21 items 1, 3 and 9: text from a user or a file never runs as SQL, and ``rtrees
sql`` is bounded in time, memory and temporary disk.

Every place where such text reaches DuckDB gets the issue's injection strings:

* ``--reuse-from`` (``train.reuse``: ``check_reuse`` / ``select_stored``, the library
  functions the CLI calls), through a TOML ``--config`` and through a run directory's
  ``config.json`` on a plain ``--resume``;
* ``rtrees sql``;
* ``rtrees audit report --study DIR`` with an edited ``study.json`` (drift, gates,
  recovery, localization, constructions, table1) and hostile values inside a study's
  data file;
* a forged Delta log naming a data file outside the store.

Each case must end in a named error, with no file created or changed outside the
store (sentinel files, and a listing of the whole test directory before and after), the
content of a secret file never in any message, and the store still holding its trees.
Real DuckDB, real Delta tables, real files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli.main import app
from rollout_store import Store, StoreError, connect
from rollout_store.maintenance import verify
from rollout_store.reader import run_query
from rollout_store.sqlguard import QueryLimitError, QueryLimits, UnsafeSQLError, checked_filter
from rollout_store.synthetic import bel_shaped_batch
from train.reuse import ReuseError, check_reuse, reuse_filter, select_stored

SECRET = "TOPSECRET-7f3a9c"  # content of the host file the attacks try to read
N_TREES = 4


# ----------------------------------------------------------------- fixtures and checks
@pytest.fixture
def box(tmp_path: Path) -> dict[str, Path]:
    """A store of 4 trees, a secret host file, and the paths attacks try to write."""
    store = Store(tmp_path / "store", create=True)
    store.append_trees(bel_shaped_batch(N_TREES, rollouts=3, depth=3, snapshot_bytes=8),
                       key="k")
    (tmp_path / "host").mkdir()
    secret = tmp_path / "host" / "secret.txt"
    secret.write_text(SECRET + "\n")
    (tmp_path / "host" / "site").mkdir()
    return {"root": tmp_path, "store": tmp_path / "store", "secret": secret,
            "leak": tmp_path / "host" / "leak.csv", "db": tmp_path / "host" / "x.db",
            "pth": tmp_path / "host" / "site" / "evil.pth",
            "pwned": tmp_path / "host" / "pwned",
            "log": tmp_path / "store" / "trees" / "_delta_log"}


HOST_TMP = Path("/tmp/x.csv")  # the literal target


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime_ns); and the issue's ``/tmp/x.csv``."""
    out = {}
    if HOST_TMP.exists():
        out[str(HOST_TMP)] = (HOST_TMP.stat().st_size, HOST_TMP.stat().st_mtime_ns)
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _assert_contained(box: dict[str, Path], before: dict[str, tuple[int, int]],
                      *texts: str, allow_new: tuple[str, ...] = ()) -> None:
    """Nothing outside the store written (no sentinel, no new or changed file except
    under ``allow_new`` prefixes), the secret's content in no message, the store whole."""
    for key in ("leak", "db", "pth", "pwned"):
        assert not box[key].exists(), f"{box[key]} was created"
    after = _listing(box["root"])
    changed = sorted(k for k in set(after) | set(before)
                     if after.get(k) != before.get(k) and not k.startswith(allow_new))
    assert not changed, f"files created or changed: {changed}"
    for text in texts:
        assert SECRET not in text, "the secret file's content leaked into a message"
    assert connect(Store(box["store"])).execute(
        "SELECT count(*) FROM trees").fetchall() == [(N_TREES,)]


def _assert_store_whole(box: dict[str, Path]) -> None:
    """Every committed byte of the store still reads, every tree rule holds."""
    report = verify(Store(box["store"]))
    assert report.ok and report.trees_checked == N_TREES, report.problems


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        app(args)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out, out.err


def _one_line_error(code: int, err: str, needle: str = "") -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    assert needle in err, err


def filter_attacks(box: dict[str, Path]) -> list[str]:
    """The issue's injection strings, aimed at this test's paths, as a reuse filter."""
    secret, leak, log = box["secret"], box["leak"], box["log"]
    data = Store(box["store"]).files("trees")[0].path
    remove = json.dumps({"remove": {"path": Path(data).name, "deletionTimestamp": 1,
                                    "dataChange": True}}).replace("'", "''")
    return [
        f"1=1; COPY (SELECT 1) TO '{leak}'",
        "1=1; COPY (SELECT 1) TO '/tmp/x.csv'",
        f"ATTACH '{box['db']}'",
        f"1=1; ATTACH '{box['db']}' AS x",
        f"read_text('{secret}') IS NOT NULL",
        f"(SELECT count(*) FROM read_text('{secret}')) > 0",
        f"run_id IN (SELECT content FROM read_text('{secret}'))",
        f"(SELECT content FROM read_text('{secret}'))::INT = 1",  # content in a cast error
        f"EXISTS (SELECT * FROM read_csv('{secret}'))",
        f"EXISTS (SELECT * FROM glob('{box['root']}/host/*'))",
        f"EXISTS (SELECT * FROM read_parquet('{data}'))",
        f"run_id IN (SELECT content FROM read_text('{log}/00000000000000000001.json'))",
        f"EXISTS (SELECT * FROM read_parquet('{log}/*.parquet'))",
        f"EXISTS (SELECT * FROM query('COPY (SELECT 1) TO ''{leak}'''))",
        # a .pth written through COPY runs code at the next Python start
        f"1=1; COPY (SELECT 'import os; open(''{box['pwned']}'', ''w'')' AS l) TO "
        f"'{box['pth']}' (HEADER false, QUOTE '')",
        # forged Delta remove: would erase the store's trees (4 -> 0)
        f"1=1; COPY (SELECT '{remove}' AS l) TO '{log}/00000000000000000002.json' "
        "(HEADER false, QUOTE '')",
        "1=1) OR (1=1",
        f"1=1) t, read_text('{secret}') s WHERE (1=1",
        f"1=1 UNION ALL SELECT 1 FROM read_text('{secret}') WHERE (1=1",
        "1=1 --",
        "1=1 /* comment */",
        "getenv('HOME') IS NOT NULL",
        "current_setting('enable_external_access')",
        "repeat('x', 100000000000) = ''",
        "count(*) > 0",
        "SET enable_external_access = true",
        "PRAGMA version",
        "INSTALL httpfs",
        "nodes.reward > 0",
        # issue 50: string bombs (OOM-killed every process that ran them)
        _nested_replace(7, "a" * 20) + " = ''",
        _nested_replace(3, "aa") + " = ''",
        "replace(task_id, 'a', meta) = ''",
        "lpad(task_id, 2000000000, 'x') = ''",
        "rpad(task_id, 2000000000, 'x') = ''",
        "string_agg(task_id, ',') = ''",
        "NOT " * 400 + "seed = 1",
    ]


def _nested_replace(depth: int, to: str) -> str:
    """``replace(replace(... task_id, 'a', to) ...)``, ``depth`` calls."""
    text = "task_id"
    for _ in range(depth):
        text = f"replace({text}, 'a', '{to}')"
    return text


# ----------------------------------------------------------------- the filter checker
def test_checked_filter_accepts_expressions_and_refuses_the_rest(box: dict[str, Path]
                                                                 ) -> None:
    for ok in ("sampler = 'bel' AND n_nodes > 2", "run_id IN ('a', 'b')",
               "run_id IN ('a;b', 'c--d', 'e/*f')", "rollouts_by_phase['probe'] > 1",
               "json_extract_string(meta, '$.x') = 'y'", "lower(env) LIKE 'ca%'",
               "created_at > TIMESTAMP '2020-01-01' AND NOT (seed = 1)",
               "trees.run_id = 'x' OR budget BETWEEN 1 AND 5",
               "CASE WHEN seed > 1 THEN true ELSE false END", "seed::DOUBLE > 0.5"):
        assert checked_filter(ok) == f"({ok})"
    for bad in filter_attacks(box):
        with pytest.raises(UnsafeSQLError, match="is not a valid filter over trees"):
            checked_filter(bad)


# ----------------------------------------------------------------- --reuse-from
def test_reuse_from_injections_are_refused_by_the_library(box: dict[str, Path]) -> None:
    store = Store(box["store"])
    before = _listing(box["root"])
    for attack in filter_attacks(box):
        with pytest.raises(ReuseError) as info:
            check_reuse(store, attack, "r")
        with pytest.raises(ReuseError) as info2:
            select_stored(store, reuse_from=attack, run_id="r", env="calc", iteration=3,
                          max_staleness=4, per_step=2, seed=0, need_snapshots=False,
                          tokenizer_dir=None)
        _assert_contained(box, before, str(info.value), str(info2.value))
    _assert_store_whole(box)


def test_valid_reuse_filters_still_select(box: dict[str, Path]) -> None:
    store = Store(box["store"])
    check_reuse(store, "sampler = 'bel' AND n_nodes > 0", "r")
    check_reuse(store, "run_id IN ('synthetic', 'other')", "r")
    check_reuse(store, "", "r")  # this run's own trees: none yet, and that is fine
    with pytest.raises(ReuseError, match="selects no stored tree"):
        check_reuse(store, "run_id IN ('a', 'b')", "r")
    with pytest.raises(ReuseError, match="not a valid filter over trees"):
        check_reuse(store, "no_such_column = 1", "r")
    # this run's id is a bound parameter, whatever it holds
    assert reuse_filter("", "it's; DROP") == ("run_id = ?", ["it's; DROP"])
    check_reuse(store, "", "it's'); COPY (SELECT 1) TO 'x'; --")


def _toml(path: Path, fields: dict[str, object]) -> Path:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return path


def test_reuse_from_injections_via_toml_config_and_resume(box: dict[str, Path],
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    from train.config import TrainConfig, load_config, read_config, write_config
    from train.trainer import TrainError, train

    attacks = filter_attacks(box)
    picked = [attacks[0], attacks[7], attacks[14], attacks[15]]  # COPY, leak, .pth, remove
    for i, attack in enumerate(picked):
        before = _listing(box["root"])
        out = box["root"] / f"run{i}"
        fields: dict[str, Any] = {"store": str(box["store"]), "out": str(out), "reuse": "all",
                  "reuse_from": attack, "progress": False}
        toml = _toml(box["root"] / f"c{i}.toml", fields)
        with pytest.raises(TrainError, match="reuse_from") as info:
            train(load_config(toml))
        code, _, err = _run(["train", "--config", str(toml)], capsys)
        _one_line_error(code, err, "reuse_from")
        assert not (out / "config.json").exists()
        _assert_contained(box, before, str(info.value), err,
                          allow_new=(f"c{i}.toml", f"run{i}"))
        # a run directory whose config.json was edited, continued with a plain --resume
        resumed = box["root"] / f"resumed{i}"
        write_config(TrainConfig(**{**fields, "out": str(resumed)}), resumed)
        before = _listing(box["root"])
        with pytest.raises(TrainError, match="reuse_from") as info:
            train(read_config(resumed), resume=True)
        code, _, err = _run(["train", "--out", str(resumed), "--resume"], capsys)
        _one_line_error(code, err, "reuse_from")
        _assert_contained(box, before, str(info.value), err, allow_new=(f"resumed{i}",))
    _assert_store_whole(box)


def test_demo_job_filter_quotes_run_ids() -> None:
    from train.demo import DemoConfig

    config = DemoConfig(env="calc", samplers=("group", "bel"))
    where = config.train_config("tiny").reuse_from
    assert checked_filter(where) == f"({where})"
    assert "'demo-calc-group-" in where and "'demo-calc-bel-" in where


# ----------------------------------------------------------------- rtrees sql
def statement_attacks(box: dict[str, Path]) -> list[str]:
    secret, leak, log = box["secret"], box["leak"], box["log"]
    data = Store(box["store"]).files("trees")[0].path
    return [
        f"COPY (SELECT 1) TO '{leak}'",
        "COPY (SELECT 1) TO '/tmp/x.csv'",
        f"ATTACH '{box['db']}'",
        f"SELECT * FROM read_text('{secret}')",
        f"SELECT * FROM read_csv('{secret}')",
        f"SELECT * FROM glob('{box['root']}/host/*')",
        f"SELECT * FROM read_text('{log}/00000000000000000001.json')",
        f"SELECT count(*) FROM trees WHERE run_id IN (SELECT content FROM "
        f"read_text('{secret}'))",
        f"SELECT (SELECT content FROM read_text('{secret}'))::INT",
        f"COPY (SELECT 'import os') TO '{box['pth']}' (HEADER false, QUOTE '')",
        f"COPY (SELECT 1) TO '{log}/00000000000000000002.json'",
        f"COPY trees TO '{data}' (FORMAT parquet)",
        "SELECT getenv('HOME')",
        "SET enable_external_access = true",
        "SELECT 1; SELECT 2",
        f"SELECT * FROM query('COPY (SELECT 1) TO ''{leak}''')",
        "INSTALL httpfs",
    ]


def test_sql_injections_are_refused(box: dict[str, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    before = _listing(box["root"])
    for q in statement_attacks(box):
        code, out, err = _run(["sql", q, "--store", str(box["store"])], capsys)
        _one_line_error(code, err)
        _assert_contained(box, before, out, err)
    _assert_store_whole(box)
    code, out, _ = _run(["sql", "SELECT count(*) AS n FROM trees", "--store",
                         str(box["store"]), "--format", "json"], capsys)
    assert code == 0 and json.loads(out) == [{"n": N_TREES}]


def test_a_forged_log_naming_a_file_outside_the_store_is_refused(
        box: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A Delta ``add`` of a Parquet file outside the store would be read as the store's
    own, and made readable to ``rtrees sql`` (``allowed_paths``)."""
    data = Path(Store(box["store"]).files("trees")[0].path)
    outside = box["root"] / "host" / "private.parquet"
    shutil.copy(data, outside)
    lines = (box["log"] / "00000000000000000001.json").read_text().splitlines()
    add = json.loads(next(line for line in lines if line.startswith('{"add"')))
    add["add"]["path"] = str(outside)
    (box["log"] / "00000000000000000002.json").write_text(json.dumps(add) + "\n")
    with pytest.raises(StoreError, match="outside the store"):
        connect(Store(box["store"]))
    code, _, err = _run(["sql", f"SELECT * FROM read_parquet('{outside}')", "--store",
                         str(box["store"])], capsys)
    _one_line_error(code, err, "outside the store")
    # every reader lists files through Store.files, so none of them opens it either
    from rollout_store import read_arrow

    with pytest.raises(StoreError, match="outside the store"):
        read_arrow(Store(box["store"]), "trees")
    for forged in ("../../host/private.parquet", "file:///etc/passwd"):
        add["add"]["path"] = forged
        (box["log"] / "00000000000000000002.json").write_text(json.dumps(add) + "\n")
        with pytest.raises(StoreError, match="outside the store"):
            Store(box["store"]).files("trees", check=False)


# ----------------------------------------------------------------- limits of rtrees sql
RECURSIVE = ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) "
             "SELECT count(*) FROM r")
BIG_SORT = "SELECT count(*) AS n FROM (SELECT * FROM range(3000000) ORDER BY random())"


def test_a_recursive_cte_stops_at_the_timeout(box: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    limits = QueryLimits(timeout_s=0.5)
    con = connect(Store(box["store"]), restricted=True, limits=limits)
    start = time.perf_counter()
    with pytest.raises(QueryLimitError, match=r"query exceeded 0.5 s"):
        run_query(con, RECURSIVE, limits)
    assert time.perf_counter() - start < 5.0
    assert run_query(con, "SELECT count(*) AS n FROM trees", limits).to_pylist() == [
        {"n": N_TREES}]  # the connection still works after the interrupt
    code, _, err = _run(["sql", RECURSIVE, "--store", str(box["store"]), "--timeout", "0.5"],
                        capsys)
    _one_line_error(code, err, "query exceeded 0.5 s")
    code, _, err = _run(["sql", "SELECT 1", "--store", str(box["store"]), "--timeout", "0"],
                        capsys)
    _one_line_error(code, err, "--timeout")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The process's temporary directory and working directory, both under ``tmp_path``."""
    tmp = tmp_path / "systmp"
    tmp.mkdir()
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(work)
    yield tmp


def test_memory_and_temp_disk_limits(box: dict[str, Path], private_tmp: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    s = ["--store", str(box["store"])]
    # no spilling by default: past --memory the query fails, and nothing lands in ./.tmp
    code, _, err = _run(["sql", BIG_SORT, *s, "--memory", "32MB"], capsys)
    _one_line_error(code, err, "memory limit of 32MB")
    # spilling allowed, but capped
    code, _, err = _run(["sql", BIG_SORT, *s, "--memory", "32MB", "--temp-disk", "2MB"],
                        capsys)
    _one_line_error(code, err, "temporary disk limit")
    # enough of both: the query runs
    code, out, err = _run(["sql", BIG_SORT, *s, "--memory", "200MB", "--temp-disk", "1GB",
                           "--format", "json"], capsys)
    assert code == 0, err
    assert json.loads(out) == [{"n": 3_000_000}]
    code, _, err = _run(["sql", "SELECT 1", *s, "--memory", "lots"], capsys)
    _one_line_error(code, err, "memory limit")
    assert list(Path.cwd().iterdir()) == []  # no ./.tmp left behind
    assert list(private_tmp.iterdir()) == []  # the private spill directories are gone


# ----------------------------------------------------------------- audit report --study
def _drift_study(root: Path) -> Path:
    """A hand-written drift study directory (``pairs.parquet`` + ``study.json``)."""
    d = root / "drift"
    d.mkdir()
    rows = [{"task_id": f"t{i % 3}", "kind": "ordinary" if i % 2 else "branch_selective",
             "kl_target": 0.2, "global_kl": 0.2 + 0.01 * (i % 3), "root": i % 4 == 0,
             "live": i % 3 != 0, "c_old": (i % 7 - 3) / 10, "c_new": (i % 5 - 2) / 10,
             "drift": (i % 5 - 2) / 10 - (i % 7 - 3) / 10, "g": (i % 6 - 2.5) / 10,
             "pairwise_kl": 0.01 * (i % 11)} for i in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), d / "pairs.parquet")
    (d / "study.json").write_text(json.dumps({
        "study": "drift", "pairs_path": "pairs.parquet", "seconds": 0.0,
        "config": {"tau": 0.02, "n_boot": 5, "seed": 0, "n_tasks": 3, "horizons": [4],
                   "kinds": ["ordinary", "branch_selective"], "kl_targets": [0.2]}}))
    return d


def _edit(study: Path, change: dict[str, object], config: dict[str, object] | None = None
          ) -> None:
    doc = json.loads((study / "study.json").read_text())
    doc.update(change)
    doc["config"] = {**doc.get("config", {}), **(config or {})}
    (study / "study.json").write_text(json.dumps(doc))


def _study_cases(box: dict[str, Path]) -> list[tuple[str, dict[str, object],
                                                      dict[str, object]]]:
    """(kind, study.json top-level changes, config changes) of each hostile edit."""
    secret, leak = box["secret"], box["leak"]
    read = f"(SELECT content FROM read_text('{secret}'))::DOUBLE"
    copy = f"0) FROM pairs; COPY (SELECT * FROM read_text('{secret}')) TO '{leak}'; SELECT (0"
    outside = str(box["root"] / "host" / "outside.parquet")
    return [
        ("drift", {}, {"tau": read}),
        ("drift", {}, {"tau": copy}),
        ("drift", {}, {"tau": "nan"}),
        ("drift", {}, {"tau": True}),
        ("drift", {}, {"n_boot": "5; COPY"}),
        ("drift", {"pairs_path": outside}, {}),
        ("drift", {"pairs_path": "../host/outside.parquet"}, {}),
        ("drift", {"pairs_path": "link.parquet"}, {}),  # a symlink to outside the study
        ("drift", {"pairs_path": 7}, {}),
        ("gates", {"instances_path": "inst.parquet", "routes_path": "routes.parquet"},
         {"regret_threshold": read}),
        ("gates", {"instances_path": "../host/outside.parquet",
                   "routes_path": "routes.parquet"}, {"regret_threshold": 0.02}),
        ("gates", {"instances_path": "inst.parquet", "routes_path": outside},
         {"regret_threshold": 0.02}),
        ("elpo-fig1", {"recovery_path": "../host/outside.parquet"},
         {"n_boot": 5, "seed": 0}),
        ("elpo-fig1", {"recovery_path": "pairs.parquet"}, {"n_boot": copy, "seed": 0}),
        ("localization", {"store": "../store", "run_id": "r"}, {}),
        ("localization", {"store": str(box["store"]), "run_id": "r"}, {}),
        ("localization", {"store": "pairs.parquet", "run_id": ["x"]}, {}),
        ("elpo-fig3", {"constructions": {}, "envs": {"calc": {"store": "../store"}}},
         {"k": 4}),
        ("elpo-fig3", {"constructions": {}, "envs": {"../../evil": {"store": "s"}}},
         {"k": 4}),
        ("elpo-fig3", {"constructions": {}, "envs": {"calc": {"store": "pairs.parquet"}}},
         {"k": "4; COPY"}),
        ("table1", {"configs": {"a": ["calc", "group", "grpo"]},
                    "runs": [{"config": "a", "seed": 0, "run_id": "r", "status": "done",
                              "dir": "../..", "store": str(box["store"])}]},
         {"steps": 1, "heldout_tasks": 1, "n_boot": 5, "boot_seed": 0,
          "tasks_per_step": 1, "n_total": 1}),
    ]


def test_study_json_values_never_become_sql(box: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from analysis.report import StudyFileError, build_study_report

    shutil.copy(Store(box["store"]).files("trees")[0].path,
                box["root"] / "host" / "outside.parquet")
    pristine = _drift_study(box["root"])
    # the unedited study builds (the checks refuse hostile values only)
    build_study_report(pristine, box["root"] / "report0")
    out = box["root"] / "reports"
    for i, (kind, change, config) in enumerate(_study_cases(box)):
        study = box["root"] / f"study{i}"
        shutil.copytree(pristine, study)
        (study / "link.parquet").symlink_to(box["root"] / "host" / "outside.parquet")
        _edit(study, {"study": kind, **change}, config)
        before = _listing(box["root"])
        with pytest.raises(StudyFileError) as info:
            build_study_report(study, out / f"lib{i}")
        code, stdout, err = _run(["audit", "report", "--out", str(out / f"cli{i}"),
                                  "--study", str(study)], capsys)
        _one_line_error(code, err)
        assert "study.json" in err or "plain name" in err, err
        _assert_contained(box, before, str(info.value), stdout, err,
                          allow_new=("reports",))
    assert not any(p.suffix == ".png" for p in (box["root"] / "host").rglob("*"))
    _assert_store_whole(box)


def test_values_inside_study_data_files_are_not_sql(box: dict[str, Path]) -> None:
    """A recovery file's ``env`` names rows (a pyarrow filter, not SQL text) and output
    files (plain names only)."""
    from analysis.recovery import recovery_envs, recovery_summary
    from analysis.report import StudyFileError

    rows = [{"task_id": "a", "trajectory": "a/0", "arm": "first_error", "step": 1,
             "n_errors": 1, "first_irrecoverable": 1, "changed": True,
             "exact_recovery": 0.5, "successes": 2, "resamples": 4,
             "env": f"x' OR 1=1 OR env IN (SELECT content FROM read_text('{box['secret']}'))"
                    " OR '"}]
    path = box["root"] / "recovery.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(StudyFileError, match="not a plain name"):
        recovery_envs(path)
    summary = recovery_summary(path, 5, 0, env=str(rows[0]["env"]))
    assert summary["arms"]["first_error"]["n"] == 1  # the row of exactly that env
    assert recovery_summary(path, 5, 0, env="x' OR '1'='1")["arms"]["first_error"]["n"] == 0
    rows[0]["env"] = "../../evil"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(StudyFileError, match="not a plain name"):
        recovery_envs(path)


def test_localization_run_id_is_a_parameter(box: dict[str, Path]) -> None:
    from analysis.localization import localization_summary

    hostile = (f"r' UNION ALL SELECT * FROM trees WHERE run_id IN (SELECT content FROM "
               f"read_text('{box['secret']}')) OR '1'='1")
    before = _listing(box["root"])
    summary = localization_summary(Store(box["store"]), hostile)
    assert summary["table"] == []  # no tree has that run id
    _assert_contained(box, before, json.dumps(summary, default=str))


def test_study_run_ids_are_parameters(box: dict[str, Path]) -> None:
    """``train.studies`` read a store by a run id from ``--param``: bound, never SQL."""
    from train.studies.workflow_study import context_snapshots, load_route_data

    hostile = "x' OR '1'='1"
    before = _listing(box["root"])
    assert context_snapshots(Store(box["store"]), hostile) == {}
    with pytest.raises(ValueError, match="no interventional trees"):
        load_route_data(Store(box["store"]), hostile)
    _assert_contained(box, before)


def test_limits_and_refusals_are_named(box: dict[str, Path]) -> None:
    con = connect(Store(box["store"]), restricted=True)
    for q in ("SET threads = 64", "SET memory_limit = '100GB'", "PRAGMA threads=64"):
        with pytest.raises(UnsafeSQLError):
            run_query(con, q)
    with pytest.raises(Exception, match="lock"):
        con.execute("SET memory_limit = '100GB'")  # locked, even outside run_query
    with pytest.raises(ValueError, match="timeout"):
        QueryLimits(timeout_s=0)
