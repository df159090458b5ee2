"""The trainer: named errors before any work, exact resume (in process and after a real
``kill -9`` of ``rtrees train``), checkpoints that are HF directories and reload as the
trees' policy_ref, metrics in the store, ``hf:PATH`` training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollout_store.reader import read_trees
from train.config import ConfigError, ConfigMismatchError, TrainConfig, load_config
from train.policies import load_policy
from train.trainer import TrainError, latest_checkpoint, read_metrics, train

SMALL = {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0, "max_new_tokens": 40,
         "minibatches": 2, "progress": False, "run_id": "r"}


def _cfg(tmp: Path, name: str, **kw: object) -> TrainConfig:
    return load_config(None, {**SMALL, "store": str(tmp / f"store-{name}"),
                              "out": str(tmp / f"run-{name}"), **kw})


def _losses(cfg: TrainConfig) -> list[float]:
    return [v for _, v in read_metrics(cfg.store, cfg.resolved_run_id)["loss"]]


def _params(out: str) -> list[torch.Tensor]:
    ckpt = latest_checkpoint(Path(out))
    assert ckpt is not None
    policy = load_policy(f"hf:{ckpt}", "calc")
    return [p.detach().clone() for p in policy.model.parameters()]  # type: ignore[attr-defined]


def test_named_errors_before_any_work(tmp_path: Path) -> None:
    for kw, match in (({"sampler": "nope"}, "unknown sampler"),
                      ({"credit": "nope"}, "unknown credit"),
                      ({"env": "nope"}, "unknown env"),
                      ({"credit": "dsc"}, "use --reuse dsc"),
                      ({"credit": "trace", "credit_params": {"ref": "tiny"}}, "drop ref="),
                      ({"credit": "trace", "reuse": "all"}, "use reuse none"),
                      ({"credit": "factor", "credit_params": {"teacher": "tiny"}},
                       "drop teacher="),
                      ({"credit": "sgcd", "reuse": "all"}, "use reuse none"),
                      ({"policy": "tabular"}, "'tiny:ENV' or 'hf:PATH'")):
        with pytest.raises(ConfigError, match=match):
            train(_cfg(tmp_path, "bad", **kw))
        assert not (tmp_path / "run-bad").exists()  # nothing written
    with pytest.raises(ConfigError, match="minibatches"):
        TrainConfig(tasks_per_step=1, minibatches=2)
    with pytest.raises(ConfigError, match="unknown config field"):
        load_config(None, {"stepz": 3})
    with pytest.raises(ConfigError, match="dynamic_sampling must be one of"):
        TrainConfig(dynamic_sampling="sometimes")
    with pytest.raises(ConfigError, match="aggregation must be one of"):
        TrainConfig(aggregation="action-sum")  # type: ignore[arg-type]


def test_resume_exact_and_checkpoints(tmp_path: Path) -> None:
    straight = _cfg(tmp_path, "a", steps=3, keep_last=2, save_every=100)
    report = train(straight)
    assert report.iterations == 3
    # split: one iteration, then resume to three
    split = _cfg(tmp_path, "b", steps=1, keep_last=2, save_every=100)
    train(split)
    train(split.replace(steps=3), resume=True)
    assert _losses(split) == _losses(straight)
    for a, b in zip(_params(straight.out), _params(split.out), strict=True):
        assert torch.equal(a, b)
    # the last keep_last checkpoints remain; each is an HF dir whose version is the trees'
    ckpts = sorted(p.name for p in (Path(straight.out) / "checkpoints").iterdir())
    assert ckpts == ["step-000000", "step-000002", "step-000003"]  # 0 % save_every == 0
    trees = read_trees(straight.store)
    assert len(trees) == 3 * 2
    kept = [t for t in trees if t.policy_ref and Path(t.policy_ref).is_dir()]
    assert kept and all(t.policy_ref and t.policy_version for t in trees)
    for t in kept:
        assert load_policy(f"hf:{t.policy_ref}", "calc").policy_version == t.policy_version
        tiny = load_policy("tiny", "calc", checkpoint=t.policy_ref)
        assert tiny.policy_version == t.policy_version
    # metrics: one loss per iteration, tree-layout ratio and the sampling-logprob check
    m = read_metrics(straight.store, "r")
    assert [s for s, _ in m["loss"]] == [0, 1, 2]
    assert all(v >= 1.0 for _, v in m["tree_token_ratio"])
    assert max(v for _, v in m["logprob_diff_max"]) < 1e-4
    # a checkpoint write killed half-way (its temporary directory) is ignored, removed
    partial = Path(straight.out) / "checkpoints" / ".step-000004.tmp-1"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"trunc")
    train(straight.replace(steps=4), resume=True)
    assert not partial.exists() and latest_checkpoint(Path(straight.out)).name == "step-000004"  # type: ignore[union-attr]
    straight = straight.replace(steps=4)
    # resuming a directory with another config names the fields
    with pytest.raises(ConfigMismatchError, match=r"lr: 0\.0003 -> 0\.1"):
        train(straight.replace(lr=0.1), resume=True)
    with pytest.raises(TrainError, match="pass --resume"):
        train(straight)
    with pytest.raises(TrainError, match="env"):
        train(_cfg(tmp_path, "c", env="workflow", store=straight.store))


def test_hf_path_policy_trains(tmp_path: Path) -> None:
    """hf:PATH on a small HF checkpoint the test saves (the tiny calc weights)."""
    tiny = load_policy("tiny", "calc")
    tiny.model.save_pretrained(tmp_path / "hf-ckpt")  # type: ignore[attr-defined]
    tiny.tokenizer.save_pretrained(tmp_path / "hf-ckpt")  # type: ignore[attr-defined]
    cfg = _cfg(tmp_path, "hf", steps=1, policy=f"hf:{tmp_path / 'hf-ckpt'}",
               tasks_per_step=4, n_total=4)
    train(cfg)
    m = read_metrics(cfg.store, "r")
    assert m["grad_norm"][0][1] > 0
    before = [p.detach() for p in tiny.model.parameters()]  # type: ignore[attr-defined]
    after = _params(cfg.out)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.slow
def test_kill9_then_resume_equals_straight_run(tmp_path: Path) -> None:
    """A real ``rtrees train`` process killed with SIGKILL mid-run, then resumed."""
    steps = 4
    straight = _cfg(tmp_path, "s", steps=steps)
    train(straight)
    killed = _cfg(tmp_path, "k", steps=steps)
    rtrees = str(Path(sys.executable).with_name("rtrees"))
    args = [rtrees, "train", "--store", killed.store, "--out", killed.out, "--steps", str(steps)]
    args += [f"--set={k}={v}" for k, v in SMALL.items()]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = Path(killed.out) / "checkpoints" / "step-000002"
    deadline = time.time() + 300
    while not target.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = latest_checkpoint(Path(killed.out))
    assert done is not None and int(done.name.split("-")[1]) < steps
    out = subprocess.run([rtrees, "train", "--out", killed.out, "--resume"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert _losses(killed) == _losses(straight)
    for a, b in zip(_params(straight.out), _params(killed.out), strict=True):
        assert torch.equal(a, b)
    # no tree or credit committed twice
    trees = read_trees(killed.store)
    assert len(trees) == len({t.tree_id for t in trees}) == steps * 2


def test_toml_config_cli_overrides_and_one_line_errors(tmp_path: Path) -> None:
    toml = tmp_path / "train.toml"
    toml.write_text('sampler = "bel"\ncredit = "elpo"\nsteps = 7\n'
                    '[sampler_params]\nb_max = 2\n')
    cfg = load_config(toml, {"steps": "9", "dual_clip": "none", "lr": "1e-3"})
    assert (cfg.sampler, cfg.credit, cfg.steps, cfg.dual_clip, cfg.lr) == \
        ("bel", "elpo", 9, None, 1e-3)
    assert cfg.sampler_params == {"b_max": 2}
    assert cfg.clip_high == TrainConfig().clip_high  # untouched fields keep the defaults
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["train", "--config", str(toml), "--store",
                                      str(tmp_path / "s"), "--out", str(tmp_path / "o"),
                                      "--sampler", "nope"])
    assert result.exit_code == 2
    assert "unknown sampler 'nope'" in result.output
    assert not (tmp_path / "o").exists()


def test_heldout_outcomes_are_stored_per_task_and_paired_across_runs(tmp_path: Path) -> None:
    """Each evaluation commits one ``evaluations`` row per (mode, held-out task) whose mean
    is the metric; two runs of other seeds evaluate the same tasks with the same stream
    seeds, so their outcomes pair (docs/METHODS.md V2)."""
    from rollout_store import Store, connect

    rates = {}
    for seed in (0, 1):
        cfg = _cfg(tmp_path, f"eval{seed}", steps=1, heldout_tasks=6, eval_every=1, seed=seed,
                   run_id=f"eval{seed}")
        train(cfg)
        con = connect(Store(cfg.store))
        rows = con.execute("SELECT step, mode, task_index, task_id, eval_seed, success "
                           "FROM evaluations ORDER BY step, mode, task_index").fetchall()
        assert [(r[0], r[1]) for r in rows] == [(s, m) for s in (-1, 0)
                                                 for m in ("greedy", "sampled")
                                                 for _ in range(6)]
        metrics = read_metrics(cfg.store, cfg.resolved_run_id)
        for step in (-1, 0):
            for mode in ("sampled", "greedy"):
                got = [r[5] for r in rows if r[0] == step and r[1] == mode]
                assert dict(metrics[f"heldout_{mode}"])[step] == pytest.approx(
                    sum(got) / len(got))
        rates[seed] = [(r[0], r[1], r[2], r[3], r[4]) for r in rows]
    assert rates[0] == rates[1]  # same tasks, same evaluation seeds: the pairing holds
