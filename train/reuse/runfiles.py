"""The reuse files of a run directory: ``OUT/reuse_params.json`` (the knobs and the D7
calibration record) and ``OUT/reuse.jsonl`` (one line per stored tree per iteration:
decisions and route values; the benchmark reads it for decision regret)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.reuse.params import CALIB_FRAC, ReuseParams


def read_record(out: Path) -> dict[str, Any]:
    path = out / "reuse_params.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_params(out: Path, params: ReuseParams,
                 calibration: Mapping[str, Any] | None = None) -> Path:
    """Record the gate's kappas, refresh and calibration knobs in
    ``OUT/reuse_params.json`` with the D7 calibration: ``calibration`` when given (what
    ``gate_params`` ran), else the one already recorded there (a resumed run keeps it),
    else a pending note naming the split."""
    path = out / "reuse_params.json"
    out.mkdir(parents=True, exist_ok=True)
    if calibration is None:
        kept = read_record(out).get("calibration")
        if isinstance(kept, dict) and kept.get("status") == "calibrated":
            calibration = kept
            params = params.with_kappas(kept["kappas"])
        else:
            calibration = {"status": "pending" if params.calibrate else
                           "off: the kappas given are used",
                           "split": f"sha256(tree_id)/2^64 < {CALIB_FRAC} (held apart, "
                           "never trained on)"}
    text = json.dumps({**params.flat(), "calibration": dict(calibration)}, indent=2)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)  # a kill never leaves half a record
    return path


def log_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line to the run's ``reuse.jsonl`` (per stored tree per iteration:
    decisions, route values; the benchmark reads it for decision regret)."""
    cut = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as fh:  # a line a kill cut stays alone on its line
        fh.write(("\n" if cut else "") + json.dumps(record, sort_keys=True) + "\n")


__all__ = ["log_line", "read_record", "write_params"]
