"""Checkpoints never run code, and resume never trusts a damaged or foreign one (issue 21
items 2, 4 and 6).

One small run (the tiny calc policy, 2 iterations of 2 tasks, checkpoints step-0..2) is
trained once; each test restores a pristine copy of its run directory and store at the
same path, damages it, and checks the outcome:

* trainer state is JSON plus safetensors: a pickle planted in a checkpoint never runs
  (the old ``trainer_state.pt`` is refused by name, never unpickled);
* a checkpoint whose ``config.json`` / ``tokenizer_config.json`` has an ``auto_map`` to a
  planted ``.py`` never runs it, through ``HFPolicy``, ``load_policy_ref`` and the
  audit's policy_ref path, with "y" waiting on stdin (no prompt is ever shown);
* each kind of damage to the newest checkpoint (truncated or missing weights, truncated
  or missing state, NaN weights, garbled metadata, garbled config, flipped bytes) and a
  checkpoint copied from another run make ``--resume`` fall back to the previous complete
  checkpoint with a one-line warning naming the damaged one; when none is usable, one
  named error line; never a traceback, never silently continued;
* ``load_policy_ref`` recomputes the version it compares (edited weights whose metadata
  still claims the old version are refused).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pristine_run import SMALL, STEPS, Run, trained
from safetensors.torch import load_file, save_file

from train.config import load_config
from train.policies import PolicyRefError, load_policy, load_policy_ref
from train.rundir import DIGESTS_KEY, META_FILE, CheckpointError, file_digests
from train.trainer import (
    OLD_STATE_FILE,
    STATE_FILE,
    STATE_TENSORS,
    TrainError,
    latest_checkpoint,
    resume_checkpoint,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return trained(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def fresh(run: Run) -> Run:
    run.restore()
    return run


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The weights, copied (``load_file`` may map the file, which a test then damages)."""
    return {k: v.clone() for k, v in load_file(str(ckpt / "model.safetensors")).items()}


def _reseal(ckpt: Path) -> None:
    """Recompute the recorded digests (what a careful forger, or a checkpoint written
    before digests existed, presents): only checks beyond the digests can catch it."""
    meta = json.loads((ckpt / META_FILE).read_text())
    meta[DIGESTS_KEY] = file_digests(ckpt)
    (ckpt / META_FILE).write_text(json.dumps(meta))


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def _nan_weights(ckpt: Path) -> None:
    tensors = _weights(ckpt)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def _flip(file: Path) -> None:
    """Flip one byte in the data section of a safetensors file (after its header)."""
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + (len(data) - header) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _garble(file: Path) -> None:
    file.write_text("{\x00not json")


def _resealed(damage: Callable[[Path], object], digests: bool = True
              ) -> Callable[[Path], object]:
    """``damage``, then the digests recomputed (or, ``digests=False``, dropped)."""
    def both(ckpt: Path) -> None:
        damage(ckpt)
        _reseal(ckpt) if digests else _drop_digests(ckpt)
    return both


def _drop_digests(ckpt: Path) -> None:
    meta = json.loads((ckpt / META_FILE).read_text())
    meta.pop(DIGESTS_KEY)
    (ckpt / META_FILE).write_text(json.dumps(meta))


DAMAGE: dict[str, Callable[[Path], object]] = {
    "truncated weights": lambda c: _truncate(c / "model.safetensors"),
    "missing weights": lambda c: (c / "model.safetensors").unlink(),
    "truncated state": lambda c: _truncate(c / STATE_TENSORS),
    "truncated state json": lambda c: _truncate(c / STATE_FILE),
    "missing state": lambda c: (c / STATE_FILE).unlink(),
    "NaN weights": _nan_weights,
    "garbled metadata": lambda c: (c / META_FILE).write_text('{"policy_version": "r-mem-'),
    "garbled config": lambda c: _garble(c / "config.json"),
    "flipped weight bytes": lambda c: _flip(c / "model.safetensors"),
    # digests recomputed after the damage (a careful forger, or a checkpoint written
    # before digests existed): the checks beyond the digests must catch these
    "NaN weights, resealed": _resealed(_nan_weights),
    "flipped weight bytes, resealed": _resealed(lambda c: _flip(c / "model.safetensors")),
    "garbled config, resealed": _resealed(lambda c: _garble(c / "config.json")),
    "no digests recorded": _drop_digests,
}


# ----------------------------------------------------------------------- item 2: no pickle

def test_trainer_state_is_json_and_safetensors(fresh: Run) -> None:
    ckpt = fresh.ckpt(STEPS)
    assert not (ckpt / OLD_STATE_FILE).exists()
    doc = json.loads((ckpt / STATE_FILE).read_text())
    assert doc["state"]["iteration"] == STEPS
    assert load_file(str(ckpt / STATE_TENSORS))  # a plain safetensors file
    meta = json.loads((ckpt / META_FILE).read_text())
    assert set(meta[DIGESTS_KEY]) == {p.name for p in ckpt.iterdir()} - {META_FILE}
    assert not list(ckpt.glob("*.pt")) and not list(ckpt.glob("*.pkl"))


class _Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.sentinel),)


def test_planted_pickle_never_runs(fresh: Run, capsys: pytest.CaptureFixture[str]) -> None:
    sentinel = fresh.root / "pwned"
    ckpt = fresh.ckpt(STEPS)
    # the old format, as a pickle with a payload: refused by name, never unpickled
    (ckpt / STATE_FILE).unlink()
    (ckpt / STATE_TENSORS).unlink()
    (ckpt / OLD_STATE_FILE).write_bytes(pickle.dumps({"iteration": STEPS,
                                                      "x": _Payload(sentinel)}))
    with pytest.raises(TrainError, match=r"trainer_state\.pt is the old pickled") as info:
        train(fresh.cfg, resume=True)
    assert "\n" not in str(info.value) and str(ckpt / OLD_STATE_FILE) in str(info.value)
    assert not sentinel.exists()
    # a pickle under the new names: a damaged checkpoint (digest), skipped, never loaded
    fresh.restore()
    for name in (STATE_TENSORS, STATE_FILE, "model.safetensors"):
        (ckpt / name).write_bytes(pickle.dumps(_Payload(sentinel)))
        _reseal(ckpt)  # even with matching digests nothing unpickles it
        resumed = resume_checkpoint(fresh.out, fresh.cfg)
        assert resumed is not None and resumed.path == fresh.ckpt(STEPS - 1), name
        assert not sentinel.exists(), name
        fresh.restore()
    assert "resuming from step-000001" in capsys.readouterr().err


def test_no_unpickling_anywhere_a_user_file_is_read() -> None:
    """The repository's loaders: no ``torch.load`` without ``weights_only=True``, no
    ``pickle.load(s)`` of a file, no ``np.load(allow_pickle=True)`` (the data-parallel
    launcher's pickle of its own rank-0 report in a private temporary directory is the
    one exception: it is never a file anyone hands over)."""
    hits = []
    for path in sorted([*ROOT.glob("train/**/*.py"), *ROOT.glob("cli/**/*.py"),
                        *ROOT.glob("analysis/**/*.py"), *ROOT.glob("rollout_store/**/*.py"),
                        *ROOT.glob("scripts/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if ("torch.load(" in code and "weights_only=True" not in code) or \
                    "allow_pickle=True" in code or "pickle.load(" in code or (
                    "pickle.loads(" in code and path.name != "launch.py"):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


# ------------------------------------------------------------- item 4: no checkpoint code

EVIL = '''
from pathlib import Path
Path({sentinel!r}).write_text("custom code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''

LOADER = '''
import json, sys
from train.policies import load_policy_ref
from train.policies.hf import HFPolicy
from train.sampling.collect import resolve_policy
out = {}
for path in sys.argv[1:]:
    for name, load in (("HFPolicy", lambda p: HFPolicy.from_pretrained(p, device="cpu")),
                       ("load_policy_ref", lambda p: load_policy_ref(p, "calc")),
                       ("audit policy_ref", lambda p: resolve_policy(p, "calc"))):
        try:
            load(path)
            out[f"{path}|{name}"] = "loaded"
        except Exception as exc:
            out[f"{path}|{name}"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


def _planted(src: Path, dst: Path, sentinel: Path, model_type: str, tokenizer: bool
             ) -> Path:
    """A copy of ``src`` whose config (and, with ``tokenizer``, tokenizer config) maps
    the Auto classes to a planted ``evil.py`` that writes ``sentinel`` when imported."""
    shutil.copytree(src, dst)
    (dst / META_FILE).unlink()  # a downloaded HF directory, no rtrees metadata
    (dst / "evil.py").write_text(EVIL.format(sentinel=str(sentinel)))
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type=model_type, architectures=["EvilModel"], auto_map={
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (dst / "config.json").write_text(json.dumps(config))
    if tokenizer:
        tok = json.loads((dst / "tokenizer_config.json").read_text())
        tok.update(tokenizer_class="EvilTokenizer",
                   auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
        (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


def test_auto_map_code_never_runs(run: Run, tmp_path: Path) -> None:
    """A real process with "y" waiting on stdin, which transformers' prompt would read."""
    sentinel = tmp_path / "sentinel"
    src = run.pristine / "run" / "checkpoints" / "step-000000"
    unknown = _planted(src, tmp_path / "evil-type", sentinel, "evil", tokenizer=True)
    tok_only = _planted(src, tmp_path / "evil-tokenizer", sentinel, "llama", tokenizer=True)
    known = _planted(src, tmp_path / "llama-type", sentinel, "llama", tokenizer=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADER, str(unknown), str(tok_only),
                           str(known)],
                          input="y\n" * 20, capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not sentinel.exists()
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for key, outcome in results.items():
        if not key.startswith(str(known)):  # no code of its own to fall back on: refused
            assert outcome.startswith(("CheckpointError", "PolicyRefError")), (key, outcome)
            assert "\n" not in outcome
        else:  # a known model type: the planted code is ignored, transformers' own runs
            assert outcome == "loaded", (key, outcome)


# ---------------------------------------------------- item 6: damaged or foreign checkpoints

@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back(fresh: Run, kind: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    damaged = fresh.ckpt(STEPS)
    DAMAGE[kind](damaged)
    resumed = resume_checkpoint(fresh.out, fresh.cfg)
    assert resumed is not None and resumed.path == fresh.ckpt(STEPS - 1)
    assert resumed.state["iteration"] == STEPS - 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("warning: checkpoint step-000002: ") and \
        err[0].endswith("resuming from step-000001"), err
    assert str(damaged) in err[0]


def test_resume_after_damage_reruns_to_the_same_weights(
        fresh: Run, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: the damaged newest checkpoint is skipped, its iteration reruns, and
    the rewritten checkpoint has the uninterrupted run's exact weights."""
    expected = _weights(fresh.ckpt(STEPS))
    _flip(fresh.ckpt(STEPS) / "model.safetensors")
    report = train(fresh.cfg, resume=True)
    assert report.iterations == STEPS
    assert "warning: checkpoint step-000002" in capsys.readouterr().err
    got = _weights(fresh.ckpt(STEPS))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert resume_checkpoint(fresh.out, fresh.cfg) is not None  # the new one verifies


def test_foreign_checkpoint_is_never_continued(fresh: Run,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints copied from another run directory (same run id and step numbers) are
    skipped by name; the run's own newest checkpoint is used."""
    other = load_config(None, {**SMALL, "steps": 1, "tasks_per_step": 1, "minibatches": 1,
                               "store": str(fresh.root / "store-b"),
                               "out": str(fresh.root / "run-b")})
    shutil.rmtree(other.out, ignore_errors=True)
    shutil.rmtree(other.store, ignore_errors=True)
    train(other)  # run b: its own step-0 and step-1
    own = Path(other.out) / "checkpoints"
    shutil.copytree(fresh.ckpt(2), own / "step-000002")
    shutil.rmtree(own / "step-000001")
    shutil.copytree(fresh.ckpt(1), own / "step-000001")
    resumed = resume_checkpoint(Path(other.out), other.replace(steps=STEPS))
    assert resumed is not None and resumed.path.name == "step-000000"
    err = capsys.readouterr().err
    assert err.count("a checkpoint of another run") == 2 and err.count("\n") == 2


def test_no_usable_checkpoint_is_one_named_error(fresh: Run) -> None:
    for step in range(STEPS + 1):
        (fresh.ckpt(step) / META_FILE).write_text("garbage")
    with pytest.raises(TrainError, match="no usable checkpoint") as info:
        train(fresh.cfg, resume=True)
    msg = str(info.value)
    assert "\n" not in msg and all(f"step-{s:06d}" in msg for s in range(STEPS + 1))
    # and as the CLI prints it: one line, exit code 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "cli.main", "train", "--out", str(fresh.out),
                           "--resume"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TrainError: no usable checkpoint")
    assert "Traceback" not in proc.stderr


def test_nan_weights_are_never_published(fresh: Run) -> None:
    from train.trainer import save_checkpoint

    policy = load_policy(f"hf:{fresh.ckpt(STEPS)}", "calc", device="cpu")
    with torch.no_grad():
        next(policy.model.parameters()).view(-1)[0] = float("inf")  # type: ignore[attr-defined]
    with pytest.raises(TrainError, match="non-finite weights"):
        save_checkpoint(fresh.out, STEPS + 1, policy, "v", {}, fresh.cfg)  # type: ignore[arg-type]
    assert not fresh.ckpt(STEPS + 1).exists()


# --------------------------------------------------- load_policy_ref recomputes the version

def test_policy_ref_recomputes_the_version(fresh: Run, tmp_path: Path) -> None:
    ckpt = fresh.ckpt(STEPS)
    version = json.loads((ckpt / META_FILE).read_text())["policy_version"]
    assert load_policy_ref(str(ckpt), "calc", version, device="cpu").policy_version == version
    # loaded in another dtype, the version is recomputed from the weights as saved
    assert load_policy(f"hf:{ckpt}", "calc", device="cpu", dtype=torch.bfloat16
                       ).policy_version == version
    def other_weights(c: Path) -> None:
        shutil.copy(fresh.ckpt(0) / "model.safetensors", c / "model.safetensors")

    cases: dict[str, Callable[[Path], object]] = {
        "flipped": lambda c: _flip(c / "model.safetensors"),
        "flipped resealed": _resealed(lambda c: _flip(c / "model.safetensors")),
        "other weights": other_weights,
        "other weights resealed": _resealed(other_weights),
        "other weights no digests": _resealed(other_weights, digests=False),
    }
    for name, damage in cases.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(ckpt, copy)
        damage(copy)
        with pytest.raises(PolicyRefError) as info:
            load_policy_ref(str(copy), "calc", version, device="cpu")
        assert "\n" not in str(info.value), name
        assert version in str(info.value), name
    # a plain HF load of the same is refused too (a named ValueError, not a wrong version)
    with pytest.raises(CheckpointError):
        load_policy(f"hf:{tmp_path / 'flipped_resealed'}", "calc", device="cpu")


def test_latest_checkpoint_sees_damaged_ones(fresh: Run) -> None:
    (fresh.ckpt(STEPS) / STATE_FILE).unlink()
    assert latest_checkpoint(fresh.out) == fresh.ckpt(STEPS)  # resume names it, never hides it


def test_default_run_id_resumes(tmp_path: Path) -> None:
    """A run without ``run_id`` (``train-`` + the directory's name) resumes: the
    checkpoint records the resolved id beside the configuration's empty one, and only
    the resolved one is compared (the empty field was compared with the resolved id,
    so no checkpoint of such a run was usable)."""
    cfg = load_config(None, {**SMALL, "run_id": "", "steps": 1, "store": str(tmp_path / "st"),
                             "out": str(tmp_path / "run")})
    train(cfg)
    resumed = resume_checkpoint(Path(cfg.out), cfg.replace(steps=2), warn=False)
    assert resumed is not None and resumed.path.name == "step-000001"


# ---- resume of a finished run (issue 21 item 10) ---------------------------------
def test_resuming_a_finished_run_prints_its_stored_result(tmp_path: Path) -> None:
    from train.config import load_config
    from train.trainer import read_metrics, train

    cfg = load_config(None, {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 2,
                             "eval_every": 1, "max_new_tokens": 24, "minibatches": 2,
                             "progress": False, "run_id": "fin", "steps": 1,
                             "store": str(tmp_path / "store"), "out": str(tmp_path / "run")})
    first = train(cfg)
    again = train(cfg, resume=True)
    stored = read_metrics(cfg.store, "fin")["heldout_sampled"][-1][1]
    assert first.summary().endswith(f"held-out success {stored:.3f} "
                                    f"(greedy {first.heldout[1]['heldout_greedy']:.3f})")
    text = again.summary()
    assert "nan" not in text  # main: "held-out success nan (greedy nan)"
    assert "already finished" in text and again.iterations == 1
    assert f"held-out success {stored:.3f}" in text
    assert again.heldout[1]["heldout_sampled"] == stored
    # A run without held-out evaluation says so instead of printing nan.
    off = cfg.replace(heldout_tasks=0, run_id="off", out=str(tmp_path / "run-off"))
    assert train(off).summary().endswith("held-out success not evaluated")
