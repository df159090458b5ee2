"""A study's settings are bounded, in ``--param`` and in ``study.json`` (issue 50 item 8).

Before the change ``n_boot=1e9`` in ``study.json`` hung ``rtrees audit report --study``
(a billion bootstrap resamples) and a ``study.json`` without ``config`` was a raw
``KeyError``; now each hostile edit below is one ``StudyFileError`` line naming the file
and the field, and the CLI prints it as one ``error:`` line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from analysis.report import (
    STUDY_FILE_MAX_ITEMS,
    STUDY_FILE_MAXIMA,
    StudyFileError,
    build_study_report,
    read_study,
)
from cli.main import app
from rollout_store import Store
from rollout_store.synthetic import bel_shaped_batch
from train.studies import STUDY_MAXIMA

CONFIG = {"tau": 0.02, "n_boot": 5, "seed": 0, "n_tasks": 3, "horizons": [4],
          "kinds": ["ordinary", "branch_selective"], "kl_targets": [0.2]}


def _drift_study(root: Path, doc: Any = None, text: str | None = None) -> Path:
    """A hand-written drift study (``pairs.parquet`` + ``study.json``)."""
    d = root / "drift"
    d.mkdir()
    rows = [{"task_id": f"t{i % 3}", "kind": "ordinary" if i % 2 else "branch_selective",
             "kl_target": 0.2, "global_kl": 0.2 + 0.01 * (i % 3), "root": i % 4 == 0,
             "live": i % 3 != 0, "c_old": (i % 7 - 3) / 10, "c_new": (i % 5 - 2) / 10,
             "drift": (i % 5 - 2) / 10 - (i % 7 - 3) / 10, "g": (i % 6 - 2.5) / 10,
             "pairwise_kl": 0.01 * (i % 11)} for i in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), d / "pairs.parquet")
    base: dict[str, Any] = {"study": "drift", "pairs_path": "pairs.parquet", "seconds": 0.0,
                            "config": dict(CONFIG)}
    (d / "study.json").write_text(text if text is not None else json.dumps(
        base if doc is None else doc(base) if callable(doc) else doc))
    return d


def _with(**config: Any) -> Any:
    return lambda base: {**base, "config": {**base["config"], **config}}


# (case, study.json edit, the message)
HOSTILE: list[tuple[str, Any, str]] = [
    ("n_boot 1e9 (a float)", _with(n_boot=1e9),
     "config.n_boot must be an integer, got 1000000000.0"),
    ("n_boot 10**9", _with(n_boot=10**9), "config.n_boot must be in [0, 100000], got "
                                           "1000000000"),
    ("n_boot 100001", _with(n_boot=100_001), "config.n_boot must be in [0, 100000]"),
    ("n_boot negative", _with(n_boot=-1), "config.n_boot must be in [0, 100000], got -1"),
    ("n_boot true", _with(n_boot=True), "config.n_boot must be an integer, got true"),
    ("n_boot a string", _with(n_boot="5"), "config.n_boot must be an integer, got \"5\""),
    ("n_tasks huge", _with(n_tasks=10**7), "config.n_tasks must be in [0, 10000]"),
    ("n_total huge", _with(n_total=10**6), "config.n_total must be in [0, 4096]"),
    ("seeds too many", _with(seeds=list(range(STUDY_FILE_MAX_ITEMS + 1))),
     "config.seeds has 10001 items, more than 10000"),
    ("tasks_per_step list element", _with(tasks_per_step=[1, 10**6]),
     "config.tasks_per_step must be in [0, 4096], got 1000000"),
    ("config missing", lambda b: {k: v for k, v in b.items() if k != "config"},
     "config is missing"),
    ("config a list", lambda b: {**b, "config": [1]}, "config must be an object, got list"),
    ("config null", lambda b: {**b, "config": None}, "config must be an object"),
]


def test_pristine_study_builds(tmp_path: Path) -> None:
    study = _drift_study(tmp_path)
    assert read_study(study)["config"]["n_boot"] == 5
    build_study_report(study, tmp_path / "report")
    assert (tmp_path / "report" / "report.md").is_file()


@pytest.mark.parametrize(("case", "edit", "message"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_study_json_is_one_line_naming_the_field(tmp_path: Path, case: str,
                                                         edit: Any, message: str) -> None:
    study = _drift_study(tmp_path, edit)
    with pytest.raises(StudyFileError) as info:
        build_study_report(study, tmp_path / "report")
    text = str(info.value)
    assert text.startswith(f"{study / 'study.json'}: ") and message in text, text
    assert "\n" not in text


def test_deep_json_is_refused(tmp_path: Path) -> None:
    study = _drift_study(tmp_path, text='{"study": "drift", "config": ' + "[" * 100_000
                         + "]" * 100_000 + "}")
    with pytest.raises(StudyFileError, match="nested too deeply"):
        read_study(study)


def test_cli_report_is_one_error_line(tmp_path: Path) -> None:
    from cli.main import app

    for edit, message in ((_with(n_boot=10**9), "config.n_boot must be in [0, 100000]"),
                          (lambda b: {k: v for k, v in b.items() if k != "config"},
                           "config is missing")):
        root = tmp_path / f"c{len(message)}"
        root.mkdir()
        study = _drift_study(root, edit)
        res = CliRunner().invoke(app, ["audit", "report", "--study", str(study), "--out",
                                       str(root / "out")])
        assert res.exit_code != 0, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.output
        assert message in lines[0] and "Traceback" not in res.output, res.output


def test_run_side_bounds_match_and_refuse_in_one_line() -> None:
    """The runner's bounds are the reader's, and ``--param n_boot=1e9`` is refused before
    anything runs."""
    assert STUDY_MAXIMA == STUDY_FILE_MAXIMA
    assert STUDY_MAXIMA["n_boot"] == 100_000
    from cli.main import app

    res = CliRunner().invoke(app, ["study", "dsc-l1", "--power", "--param",
                                   "n_boot=1000000000"])
    assert res.exit_code != 0
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "n_boot must be <= 100000" in lines[0], res.output


# ---- a requested study that was not built (issue 21 item 10) --------------------
def test_audit_report_fails_when_a_requested_study_was_not_built(tmp_path: Path) -> None:
    study = tmp_path / "drift-study"
    study.mkdir()  # never run: no study.json
    result = CliRunner().invoke(app, ["audit", "report", "--study", str(study),
                                      "--out", str(tmp_path / "reports")])
    assert result.exit_code == 1, result.output  # main: 0, with a "not built" note
    assert f"error: requested study {study} was not built" in result.output
    assert "holds no study.json" in result.output
    # The store's own audits with nothing to report are notes, as before: exit 0.
    store = Store(tmp_path / "store", create=True)
    store.append_trees(bel_shaped_batch(2, seed=1), key="a")
    result = CliRunner().invoke(app, ["audit", "report", "--store", str(tmp_path / "store"),
                                      "--out", str(tmp_path / "reports2")])
    assert result.exit_code == 0, result.output
