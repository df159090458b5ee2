"""Power before running (docs/METHODS.md V3-V5): ``analysis.power.study_power``."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest

from analysis.power import PILOT_SD, study_power
from analysis.verdicts import Design, family_level


def _table1(**kw: object) -> dict[str, object]:
    from train.studies.table1 import Table1Config

    return asdict(Table1Config(**kw))  # type: ignore[arg-type]


def test_table1_power_is_the_v5_design_at_the_bonferroni_level() -> None:
    st = study_power("table1", _table1())
    assert st.sizes == {"seeds": 3, "held-out tasks": 100, "claims": 5}
    assert st.level == pytest.approx(family_level(5))
    assert st.mde == pytest.approx(Design().detectable(3, 100, 0.98))
    assert st.mde > 0.1  # 3 seeds cannot see the papers' few points
    need = study_power("table1", _table1(heldout_tasks=200), effect=0.05).needed
    n = need["seeds"]
    assert n is not None and Design().detectable(n, 200, 0.98) <= 0.05
    assert Design().detectable(n - 1, 200, 0.98) > 0.05
    lines = study_power("table1", _table1(), effect=0.05).lines()
    assert lines[0].startswith("power: paired difference") and "MDE" in lines[0]
    assert "to detect 0.05" in lines[1] and "assumptions" in lines[2]


def test_task_studies_use_their_pilot_sd() -> None:
    st = study_power("dsc-table2", {"n_eval": 120}, effect=0.001)
    sd = PILOT_SD["dsc-table2"][1]
    z = 1.959964 + 0.841621
    assert st.mde == pytest.approx(z * sd / math.sqrt(120), rel=1e-4)
    assert st.needed["n_eval"] == math.ceil((z * sd / 0.001) ** 2)
    assert study_power("elpo-fig3", {"n_tasks": 48}).sizes == {"n_tasks": 48}


def test_bad_requests_are_named() -> None:
    with pytest.raises(ValueError, match="effect"):
        study_power("table1", _table1(), effect=math.nan)
    with pytest.raises(ValueError, match="no power statement"):
        study_power("nope", {})


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from cli.main import app

    with pytest.raises(SystemExit) as info:
        app(args)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out, out.err


def _one_line_error(code: int, err: str, needle: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0], err


def test_rtrees_study_power_prints_without_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, assert_one_line_error = _run, _one_line_error
    code, out, _ = run(["study", "table1", "--power", "--effect", "0.05",
                        "--param", "heldout_tasks=200"], capsys)
    assert code == 0
    need = study_power("table1", _table1(heldout_tasks=200), effect=0.05)
    assert out.splitlines() == need.lines()
    assert not any(tmp_path.iterdir())
    code, _, err = run(["study", "table1"], capsys)
    assert_one_line_error(code, err, "--out is required")
    code, _, err = run(["study", "table1", "--effect", "0.05", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "--power")
    code, _, err = run(["study", "table1", "--power", "--effect", "-1"], capsys)
    assert_one_line_error(code, err, "effect")
    assert not any(tmp_path.iterdir())


def test_one_seed_states_there_is_no_mde() -> None:
    """A table1 process given one seed (one per core, sharing a directory) says it has no
    MDE instead of printing nan."""
    line = study_power("table1", {**_table1(), "seeds": [0]}).lines()[0]
    assert "nan" not in line and "no MDE" in line
