"""Loading a DCP checkpoint runs no code from it (issue 27 with the hardening rule: a
checkpoint is a file a user could be handed). torch writes DCP's ``.metadata`` with
``pickle`` and reads its non-tensor entries with ``weights_only=False``;
``train.fsdp._safe_storage`` reads both without running pickled code."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from train.fsdp import CheckpointPickleError, _safe_storage


def _save(where: Path) -> dict[str, object]:
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 3).state_dict(),
             "optim": {"param_groups": [{"lr": 0.003, "betas": (0.9, 0.999), "params": [0]}],
                       "step": 7}}
    dcp.save(state, checkpoint_id=str(where), no_dist=True)
    return state


def test_a_dcp_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    saved = _save(tmp_path / "dcp")
    target = {"model": torch.nn.Linear(4, 3).state_dict(),
              "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [0]}],
                        "step": 0}}
    reader, planner = _safe_storage(str(tmp_path / "dcp"))
    dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
    for k, v in saved["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(target["model"][k], v)
    assert target["optim"] == saved["optim"]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_pickle_never_runs(tmp_path: Path) -> None:
    _save(tmp_path / "dcp")
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    reader, _ = _safe_storage(str(tmp_path / "dcp"))
    with pytest.raises(CheckpointPickleError, match=r"(posix|os)\.system"):
        reader.read_metadata()
    assert not marker.exists()
