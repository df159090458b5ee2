"""A forged trainer state is caught (issue 50 item 7).

One small run (the tiny calc policy, 2 iterations, checkpoints step-0..2) is trained once;
each test restores a pristine copy of its run directory and store, forges one field of
the newest checkpoint's ``trainer_state.json`` (or its tensors, or its weights) and then
*reseals* it: the digests in ``rtrees_policy.json`` recomputed, as a careful forger
would. Before the change every one of these was accepted by ``--resume`` (only the
iteration had a check of its own); now each is refused by name, and resume falls back to
the previous checkpoint with a one-line warning. The store's records are the anchor:
the binding in the state agrees with the weights, ``config.json``'s run token, the
store's run-token row and the store's committed versions, and every field's digest with
the record the store committed when the checkpoint was written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pristine_run import SMALL, STEPS, Run, trained
from safetensors.torch import load_file, save_file

from rollout_store.reader import connect
from rollout_store.store import Store
from train.config import CONFIG_FILE, RUN_TOKEN, load_config
from train.policies.hf import state_dict_version, weights_version
from train.rundir import (
    BINDING_KEY,
    DIGESTS_KEY,
    META_FILE,
    RUN_TOKEN_METRIC,
    RUN_TOKEN_STEP,
    STATE_RECORD_STEP,
    CheckpointError,
    StateBinding,
    file_digests,
    load_state,
    save_state,
)
from train.trainer import (
    OWNER_METRIC,
    OWNER_STEP,
    STATE_FILE,
    STATE_TENSORS,
    load_checkpoint,
    load_start_policy,
    resume_checkpoint,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return trained(tmp_path_factory.mktemp("bind"))


@pytest.fixture
def fresh(run: Run) -> Run:
    run.restore()
    return run


def _reseal(ckpt: Path) -> None:
    """The forger's last step: every digest of ``rtrees_policy.json`` recomputed."""
    meta = json.loads((ckpt / META_FILE).read_text())
    meta[DIGESTS_KEY] = file_digests(ckpt)
    (ckpt / META_FILE).write_text(json.dumps(meta))


def _edit_doc(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(ckpt: Path) -> None:
        doc = json.loads((ckpt / STATE_FILE).read_text())
        edit(doc)
        (ckpt / STATE_FILE).write_text(json.dumps(doc) + "\n")
    return apply


def _set_rng(doc: dict[str, Any]) -> None:
    py = doc["state"]["rng"]["python"]["$tuple"]  # (version, internal state, gauss)
    py[1]["$tuple"][0] ^= 1


def _edit_tensor(name: str) -> Callable[[Path], None]:
    """Add 1 to the first element of the first tensor ``name`` (a state field) references."""
    def apply(ckpt: Path) -> None:
        doc = json.loads((ckpt / STATE_FILE).read_text())
        text = json.dumps(doc["state"][name])
        key = text.split('"$tensor": "', 1)[1].split('"', 1)[0]
        tensors = {k: v.clone() for k, v in load_file(str(ckpt / STATE_TENSORS)).items()}
        tensors[key].view(-1)[0] += 1
        save_file(tensors, str(ckpt / STATE_TENSORS))
    return apply


def _swap_weights(ckpt: Path) -> None:
    """Edited weights with the policy version in the metadata recomputed too (what the
    checks before the state's compare), so only the state's weights digest can catch
    them."""
    weights = {k: v.clone() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    name = sorted(weights)[0]
    weights[name].view(-1)[0] += 0.5
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    _reseal(ckpt)
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["policy_version"] = weights_version(ckpt)  # a version the loader accepts, first
    (ckpt / META_FILE).write_text(json.dumps(meta))
    model = load_start_policy(load_config(None, SMALL), ckpt).model
    meta["policy_version"] = f"r-{state_dict_version(model)}"
    (ckpt / META_FILE).write_text(json.dumps(meta))


def _token_everywhere(ckpt: Path) -> None:
    """A forged run token in the state and in config.json: only the store disagrees."""
    _edit_doc(lambda d: d[BINDING_KEY].update(run_token=d[BINDING_KEY]["run_token"] + 1))(
        ckpt)
    config = ckpt.parents[1] / CONFIG_FILE
    doc = json.loads(config.read_text())
    doc[RUN_TOKEN] += 1
    config.write_text(json.dumps(doc))


def _versions(delta: dict[str, int]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for table, d in delta.items():
            doc["state"]["store_version"][table] += d
    return edit


# forgery -> what the refusal names (the newest checkpoint, resealed after the edit)
FORGERIES: dict[str, tuple[Callable[[Path], None], str]] = {
    "rng state": (_edit_doc(_set_rng),
                  "rng differs from the trainer state the store recorded for step 2"),
    "iteration": (_edit_doc(lambda d: d["state"].update(iteration=1)),
                  "step 2 (iteration 1) is not this checkpoint's step 2"),
    "binding step": (_edit_doc(lambda d: d[BINDING_KEY].update(step=1)),
                     "step 1 (iteration 2) is not this checkpoint's step 2"),
    "run token": (_edit_doc(lambda d: d[BINDING_KEY].update(run_token=12345)),
                  "run token 12345 does not match the run directory's config.json"),
    "run token and config.json": (_token_everywhere,
                                  "does not match the store's run_token row of run 'r'"),
    "run id": (_edit_doc(lambda d: d[BINDING_KEY].update(run_id="other")),
               "run id 'other' is not this run's 'r'"),
    "weights digest": (_edit_doc(lambda d: d[BINDING_KEY]["weights"].update(
        {"model.safetensors": "0" * 64})),
        "the weights digest does not match model.safetensors"),
    "weights replaced": (_swap_weights, "the weights digest does not match model.safetensors"),
    "weights file list": (_edit_doc(lambda d: d[BINDING_KEY]["weights"].update(
        {"extra.safetensors": "0" * 64})), "records weights files"),
    "store version from the future": (_edit_doc(_versions({"trees": 100})),
                                      "store_version trees="),
    "store version before its commits": (_edit_doc(_versions({"trees": -1, "metrics": -1})),
                                         "predates the commit of iteration 1's"),
    "store version, other table": (_edit_doc(_versions({"nodes": -1})),
                                   "store_version differs from the trainer state"),
    "store version garbage": (_edit_doc(lambda d: d["state"].update(store_version="x")),
                              "store_version 'x' is not a version of the store's tables"),
    "optimizer tensors": (_edit_tensor("optimizer"), "optimizer differs"),
    "scheduler": (_edit_doc(lambda d: d["state"]["scheduler"].update(last_epoch=99)),
                  "scheduler differs"),
    "sampler state": (_edit_doc(lambda d: d["state"].update(sampler_state={"x": 1})),
                      "sampler_state differs"),
    "extra field": (_edit_doc(lambda d: d["state"].update(note=1)), "note differs"),
    "binding removed": (_edit_doc(lambda d: d.pop(BINDING_KEY)), "records no binding"),
}


def test_pristine_run_resumes_from_the_newest(fresh: Run) -> None:
    resumed = resume_checkpoint(fresh.out, fresh.cfg)
    assert resumed is not None and resumed.path == fresh.ckpt(STEPS)
    doc = json.loads((fresh.ckpt(STEPS) / STATE_FILE).read_text())
    token = json.loads((fresh.out / CONFIG_FILE).read_text())[RUN_TOKEN]
    assert doc[BINDING_KEY]["run_token"] == token and doc[BINDING_KEY]["step"] == STEPS
    assert set(doc[BINDING_KEY]["weights"]) == {"model.safetensors"}
    # one record per checkpoint, hidden from the training metrics
    rows = connect(Store(fresh.cfg.store)).execute(
        "SELECT DISTINCT split_part(name, '/', 2) FROM metrics WHERE step = $s",
        {"s": STATE_RECORD_STEP}).fetchall()
    assert sorted(r[0] for r in rows) == [f"{s:06d}" for s in range(STEPS + 1)]
    assert (RUN_TOKEN_METRIC, RUN_TOKEN_STEP) == (OWNER_METRIC, OWNER_STEP)


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forged_state_is_refused_by_name(fresh: Run, kind: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    forge, message = FORGERIES[kind]
    forged = fresh.ckpt(STEPS)
    forge(forged)
    _reseal(forged)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(forged, fresh.cfg)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert text.startswith(str(forged / STATE_FILE)), text
    if kind != "run token and config.json":  # config.json's token is the run's own: all fail
        resumed = resume_checkpoint(fresh.out, fresh.cfg)
        assert resumed is not None and resumed.path == fresh.ckpt(STEPS - 1)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and err[0].endswith(
            "resuming from step-000001"), err


def test_state_copied_from_another_step_is_refused(fresh: Run) -> None:
    """step-1's whole state (and tensors) planted in step-2, resealed."""
    for name in (STATE_FILE, STATE_TENSORS):
        shutil.copy(fresh.ckpt(1) / name, fresh.ckpt(2) / name)
    _reseal(fresh.ckpt(2))
    with pytest.raises(CheckpointError, match="is not this checkpoint's step 2"):
        load_checkpoint(fresh.ckpt(2), fresh.cfg)


def test_store_without_records_is_refused(fresh: Run) -> None:
    """Another store holding the same run token (a store that never recorded the
    states): the newest state's versions are ahead of it; step-0's are not, and its
    missing record is named."""
    shutil.rmtree(fresh.cfg.store)
    store = Store(fresh.cfg.store, create=True)
    from train.trainer import claim_run_id

    token = json.loads((fresh.out / CONFIG_FILE).read_text())[RUN_TOKEN]
    claim_run_id(store, "r", token, fresh=True)
    with pytest.raises(CheckpointError, match="is newer than the store"):
        load_checkpoint(fresh.ckpt(STEPS), fresh.cfg)
    with pytest.raises(CheckpointError, match="the store records no trainer state for step 0"):
        load_checkpoint(fresh.ckpt(0), fresh.cfg)  # an empty store: versions 0 pass


def test_save_and_load_state_binding_without_training(tmp_path: Path) -> None:
    """The binding on its own: round trip, then each edit refused (no trainer)."""
    store = Store(tmp_path / "store", create=True)
    from train.trainer import claim_run_id

    claim_run_id(store, "x", 7, fresh=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.ones(3)}, str(ckpt / "model.safetensors"))
    state = {"iteration": 3, "rng": (1, [2.5]), "opt": torch.arange(4.0),
             "store_version": dict(store.version())}
    bind = StateBinding("x", 3, 7, store)
    digests = save_state(state, ckpt / "s.json", ckpt / "s.tensors", bind)
    assert set(digests) == {"iteration", "rng", "opt", "store_version", BINDING_KEY}
    back = load_state(ckpt / "s.json", ckpt / "s.tensors", bind)
    assert back["rng"] == (1, [2.5]) and torch.equal(back["opt"], torch.arange(4.0))
    with pytest.raises(CheckpointError, match=r"run token 7 does not match the run "
                                              r"directory's config.json \(8\)"):
        load_state(ckpt / "s.json", ckpt / "s.tensors", StateBinding("x", 3, 8, store))
    save_file({"opt_t0": torch.arange(4.0) + 1}, str(ckpt / "s.tensors"))
    with pytest.raises(CheckpointError, match="tensor 't0' is not in"):
        load_state(ckpt / "s.json", ckpt / "s.tensors", bind)
    save_file({"t0": torch.arange(4.0) + 1}, str(ckpt / "s.tensors"))
    with pytest.raises(CheckpointError, match="opt differs from the trainer state"):
        load_state(ckpt / "s.json", ckpt / "s.tensors", bind)
    save_file({"w": torch.zeros(3)}, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"the weights digest does not match "
                                              r"model\.safetensors"):
        load_state(ckpt / "s.json", ckpt / "s.tensors", bind)
