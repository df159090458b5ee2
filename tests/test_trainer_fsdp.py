"""FSDP2 and distributed checkpoints (issue 27, ``train.fsdp``): real gloo process groups
of spawned ranks on 127.0.0.1, torch's own ``fully_shard`` and
``torch.distributed.checkpoint``, no mocks.

The training step is the trainer's loss step in miniature: ``forward_logprobs`` (decoder
and LM head called directly, head at loss columns only), every rank's loss over its
own sequences divided by the GLOBAL denominator, AdamW, gradient clipping; 3 sequences
per step over 2 ranks, so rank 1 holds fewer and runs ``dummy_backward``.

* 2 FSDP2 ranks equal 1 unsharded rank within 1e-5 (per-step loss, final weights);
* a DCP checkpoint saved by 2 ranks resumes on 1 rank and on 3 ranks and continues with
  the losses and weights of an uninterrupted 2-rank run (within 1e-5: float summation
  order differs with the shard layout); its full-weight HF export loads with
  ``from_pretrained`` and its digests verify (slow);
* rank 1 SIGKILLed at a save: nothing is published, the previous checkpoint is intact,
  and resuming from it continues bit-identically (slow).

Through the trainer (``rtrees train --shard fsdp``: ``train.launch.launch`` and the CLI,
the tiny policy's 4-layer Llama sharded per decoder layer; the data-parallel tests'
``SMALL`` run of ``tests/test_trainer_ddp.py``: 4 trees per iteration in 2 mini-batches;
with seed 5 every mini-batch of the first two iterations holds the trees of one rank, so
the other runs a zero-weight pass at every optimizer step; on 3 ranks some always does):

* ``--shard fsdp`` on 2 ranks equals the unsharded 1-rank trainer within 1e-5 (per-step
  losses, the trees and the final published weights), tree layout (paths: slow);
* a run checkpointed by 2 ranks resumes on 1 rank, then on 3, and gives the per-step
  losses of an uninterrupted 2-rank run within 1e-5 relative, the same trees, weights
  within 1e-5 (slow);
* ``kill -9`` of one rank of ``rtrees train --nproc 2 --shard fsdp``, then ``--resume``:
  the losses and weights of the uninterrupted run exactly (slow);
* a bad ``shard`` is one line naming the field.
"""

from __future__ import annotations

import os
import signal
import socket
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_helpers import kill_rank_then_resume, train_with_rank_threads

VOCAB, STEPS, SEQS = 50, 4, 3


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=True, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _batch(step: int, j: int) -> types.SimpleNamespace:
    """Sequence j of step ``step``: 2 padded rows of 10 tokens, 4 loss tokens with
    advantages (what ``forward_logprobs`` reads of a ``MicroBatch``)."""
    g = torch.Generator().manual_seed(1000 * step + j)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 8:] = 0  # the second row is shorter: right padding
    return types.SimpleNamespace(
        input_ids=torch.randint(0, VOCAB, (2, 10), generator=g),
        position_ids=torch.arange(10).expand(2, 10), attention_mask=mask,
        loss_row=torch.tensor([0, 0, 1, 1]), loss_col=torch.tensor([3, 4, 5, 6]),
        targets=torch.randint(0, VOCAB, (4,), generator=g),
        advantage=torch.randn(4, generator=g), tree_tout=None)


def _rank(rank: int, size: int, port: int, job: dict[str, Any]) -> None:
    """One rank: steps [start, stop) from a fresh model or ``job['load']``; optionally
    ``save_sharded`` at the end; rank 0 writes losses and full weights to ``job['out']``."""
    from train.distributed import World, all_sum, init_world, leave_process
    from train.forward import forward_logprobs
    from train.fsdp import (
        dummy_backward,
        full_state_dict,
        load_sharded,
        passes_needed,
        save_sharded,
        shard_model,
    )

    torch.set_num_threads(1)
    world = World()
    if size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        world = init_world()
    model = _model()
    shard_model(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if job.get("load"):
        load_sharded(Path(job["load"]), model, opt)
    losses = []
    for step in range(job["start"], job["stop"]):
        opt.zero_grad(set_to_none=True)
        mine = [_batch(step, j) for j in range(SEQS) if world.owns(j)]
        d = all_sum(world, [4.0 * len(mine)])[0]  # the global token count
        passes = passes_needed(world, len(mine))  # agreed before the first collective pass
        total = 0.0
        for mb in mine:
            logp, _ = forward_logprobs(model, mb)  # type: ignore[arg-type]
            loss = -(logp * mb.advantage).sum() / d
            loss.backward()
            total += float(loss)
        for _ in range(passes - len(mine)):
            dummy_backward(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(all_sum(world, [total])[0])
    if job.get("kill") == rank:  # dies as kill -9 would, before its shard is written
        os.kill(os.getpid(), signal.SIGKILL)
    if job.get("save"):
        def fill(tmp: Path, full: dict[str, torch.Tensor]) -> None:
            plain = _model()
            plain.load_state_dict(full)
            plain.save_pretrained(tmp)

        save_sharded(Path(job["save"]), world, model, opt, {"step": job["stop"]}, fill)
    full = full_state_dict(model)
    if world.is_main:
        torch.save({"losses": losses, "weights": full}, job["out"])
    if size > 1:
        # A rank aborted at exit in CI ("terminate called without an active exception")
        # after every result was written, even with a barrier before the destroy: the
        # device mesh keeps the gloo group alive into finalization. Leave as ranks of
        # ``rtrees train`` do (``train.distributed.leave_process``).
        dist.barrier()
        dist.destroy_process_group()
        leave_process(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(size: int, **job: Any) -> dict[str, Any]:
    if size == 1:
        _rank(0, 1, 0, job)
    else:
        mp.start_processes(_rank, args=(size, _free_port(), job), nprocs=size,
                           start_method="spawn")
    result: dict[str, Any] = torch.load(job["out"], weights_only=True)
    return result


def _close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5, abs=1e-7)
    assert sorted(a["weights"]) == sorted(b["weights"])
    for k, v in a["weights"].items():
        torch.testing.assert_close(b["weights"][k], v, rtol=0, atol=1e-5)


def test_fsdp_two_ranks_equal_one_unsharded_rank(tmp_path: Path) -> None:
    one = _run(1, start=0, stop=STEPS, out=str(tmp_path / "one.pt"))
    two = _run(2, start=0, stop=STEPS, out=str(tmp_path / "two.pt"))
    _close(one, two)
    assert len(two["losses"]) == STEPS and all(x == x for x in two["losses"])
    # the model moved: the comparison is not of untouched initial weights
    init = _model().state_dict()
    assert max(float((two["weights"][k] - v).abs().max()) for k, v in init.items()) > 1e-3


@pytest.mark.slow  # about 2 min here: 4 process groups of 2, 2, 1 and 3 ranks
def test_save_two_ranks_resume_one_and_three(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from train.rundir import verify_checkpoint

    straight = _run(2, start=0, stop=STEPS, out=str(tmp_path / "straight.pt"))
    ckpt = tmp_path / "ckpt" / "step-000002"
    half = _run(2, start=0, stop=2, save=str(ckpt), out=str(tmp_path / "half.pt"))
    assert half["losses"] == pytest.approx(straight["losses"][:2], rel=1e-6)
    meta = verify_checkpoint(ckpt, require=("config.json", "model.safetensors",
                                            "dcp/.metadata"))
    assert meta["step"] == 2 and not list(ckpt.parent.glob(".step-*"))
    exported = LlamaForCausalLM.from_pretrained(ckpt).state_dict()
    for k, v in half["weights"].items():
        assert torch.equal(exported[k], v), k
    for size in (1, 3):
        rest = _run(size, start=2, stop=STEPS, load=str(ckpt),
                    out=str(tmp_path / f"rest{size}.pt"))
        _close({"losses": straight["losses"][2:], "weights": straight["weights"]}, rest)


@pytest.mark.slow  # about 2 min here
def test_kill9_of_one_rank_then_resume_continues_exactly(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at the step-2 save: no step-2 checkpoint appears (rank 0 never
    publishes), step 1 stays intact, and resuming from it on 2 ranks gives bit-identical
    losses and weights to an uninterrupted run."""
    from train.rundir import verify_checkpoint

    straight = _run(2, start=0, stop=STEPS, out=str(tmp_path / "straight.pt"))
    one = tmp_path / "ckpt" / "step-000001"
    _run(2, start=0, stop=1, save=str(one), out=str(tmp_path / "a.pt"))
    two = tmp_path / "ckpt" / "step-000002"
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        _run(2, start=1, stop=2, load=str(one), save=str(two), kill=1,
             out=str(tmp_path / "b.pt"))
    assert not two.exists()
    verify_checkpoint(one, require=("dcp/.metadata",))
    rest = _run(2, start=1, stop=STEPS, load=str(one), out=str(tmp_path / "c.pt"))
    assert rest["losses"] == straight["losses"][1:]
    for k, v in straight["weights"].items():
        assert torch.equal(rest["weights"][k], v), k


# ---------------------------------------------------------------- through the trainer

SMALL = {"tasks_per_step": 4, "n_total": 2, "heldout_tasks": 0, "max_new_tokens": 40,
         "minibatches": 2, "progress": False, "run_id": "r", "seed": 3}


def _cfg(tmp: Path, name: str, **kw: object) -> Any:
    from train.config import load_config

    return load_config(None, {**SMALL, "store": str(tmp / f"store-{name}"),
                              "out": str(tmp / f"run-{name}"), **kw})


def _weights(out: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """The weights a run published (its newest checkpoint, or ``step``'s), loaded as
    ``hf:PATH`` loads them (the rank-0 HF export)."""
    from train.policies import load_policy
    from train.trainer import checkpoint_dir, latest_checkpoint

    ckpt = latest_checkpoint(Path(out)) if step is None else checkpoint_dir(Path(out), step)
    assert ckpt is not None
    model = load_policy(f"hf:{ckpt}", "calc").model  # type: ignore[attr-defined]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _losses(cfg: Any) -> list[float]:
    from train.trainer import read_metrics

    return [v for _, v in read_metrics(cfg.store, cfg.resolved_run_id)["loss"]]


def _texts(cfg: Any) -> dict[str, list[str | None]]:
    from rollout_store.reader import read_trees

    return {t.tree_id: [n.action_text for n in t.nodes] for t in read_trees(cfg.store)}


def _weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                   atol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize("layout", ["tree", pytest.param("paths", marks=pytest.mark.slow)])
def test_trainer_fsdp_two_ranks_equal_unsharded_one_rank(tmp_path: Path, layout: str) -> None:
    """2 iterations: ``launch(--shard fsdp, nproc 2)`` vs ``train(--shard none)``; the
    1-rank reference runs with each rank's intra-op threads (as in test_trainer_ddp)."""
    from train.launch import launch
    from train.trainer import _minibatch_parts

    one = _cfg(tmp_path, "one", steps=2, layout=layout, seed=5)
    two = _cfg(tmp_path, "two", steps=2, layout=layout, seed=5, shard="fsdp")
    for it in range(2):  # each mini-batch's trees lie on one rank: the other's passes are
        assert all(len({j % 2 for j in part}) == 1  # zero-weight ones (dummy_backward)
                   for part in _minibatch_parts(4, two, it))
    train_with_rank_threads(one)
    assert launch(two, nproc=2).iterations == 2
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5, abs=1e-7)
    assert _texts(two) == _texts(one)  # the same trees, sampled from the full replica
    final = _weights(two.out)
    _weights_close(_weights(one.out), final)
    start = _weights(two.out, 0)  # the model moved
    assert max(float((final[k] - v).abs().max()) for k, v in start.items()) > 1e-4
    ckpt = Path(two.out) / "checkpoints" / "step-000002"
    assert (ckpt / "dcp" / ".metadata").is_file() and len(list((ckpt / "dcp").glob(
        "*.distcp"))) == 2  # one shard file per rank


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An uninterrupted 4-iteration 2-rank ``--shard fsdp`` run (the slow tests' reference)."""
    from train.launch import launch

    cfg = _cfg(tmp_path_factory.mktemp("fsdp-straight"), "s", steps=4, shard="fsdp")
    launch(cfg, nproc=2)
    return cfg


@pytest.mark.slow
def test_trainer_fsdp_save_two_ranks_resume_one_then_three(tmp_path: Path,
                                                           straight: Any) -> None:
    """Iterations 0-1 on 2 ranks, 2 on 1 rank (unsharded: DCP loads without a process
    group), 3 on 3 ranks (rank 0 samples trees 0 and 3): the losses, trees and weights of
    the uninterrupted 2-rank run."""
    from train.launch import launch
    from train.rundir import verify_checkpoint

    cfg = _cfg(tmp_path, "k", steps=2, shard="fsdp")
    launch(cfg, nproc=2)
    meta = verify_checkpoint(Path(cfg.out) / "checkpoints" / "step-000002",
                             require=("dcp/.metadata", "model.safetensors",
                                      "trainer_state.json"))
    assert meta["config"]["shard"] == "fsdp" and meta["step"] == 2
    launch(cfg.replace(steps=3), resume=True, nproc=1)
    launch(cfg.replace(steps=4), resume=True, nproc=3)
    assert _losses(cfg) == pytest.approx(_losses(straight), rel=1e-5, abs=1e-7)
    assert _texts(cfg) == _texts(straight)
    _weights_close(_weights(straight.out), _weights(cfg.out))


@pytest.mark.slow
def test_trainer_fsdp_kill9_one_rank_then_resume(tmp_path: Path, straight: Any) -> None:
    """``rtrees train --nproc 2 --shard fsdp``, SIGKILL of rank 1 once step-000002 is
    published, ``--resume --nproc 2``: the losses and weights of the uninterrupted run,
    exactly; no staging directory is left behind."""
    killed = _cfg(tmp_path, "k", steps=4, shard="fsdp")
    kill_rank_then_resume(["--store", killed.store, "--out", killed.out, "--steps", "4",
                           "--nproc", "2", "--shard", "fsdp",
                           *(f"--set={k}={v}" for k, v in SMALL.items())], killed.out, 4)
    assert _losses(killed) == _losses(straight)
    a, b = _weights(straight.out), _weights(killed.out)
    for k, v in a.items():
        assert torch.equal(b[k], v), k
    assert not list((Path(killed.out) / "checkpoints").glob(".step-*"))


def test_bad_shard_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    from cli.main import app

    for args in (["--shard", "zero"], ["--set", "shard=zero"]):
        with pytest.raises(SystemExit) as info:
            app(["train", "--store", str(tmp_path / "st"), "--out", str(tmp_path / "run"),
                 *args])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert info.value.code != 0
        assert len(err) == 1 and err[0].startswith("error:") and "shard" in err[0], err
        assert "zero" in err[0] and "fsdp" in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "st").exists()
