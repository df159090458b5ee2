"""Models whose attention code does not take the tree layout's mask (GPT-2's in
transformers 5 reads ``attention_mask.ndim`` of a FlexAttention ``BlockMask``) train in
the ``paths`` layout with a one-line note (``train.forward.tree_layout_problem``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.config import load_config
from train.forward import tree_layout_problem
from train.policies.tiny import load_tiny_policy
from train.trainer import read_metrics, train


def gpt2_checkpoint(path: Path) -> Path:
    """A randomly initialised 1-layer GPT-2 with the tiny policy's tokenizer and chat
    template, saved as a transformers checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = load_tiny_policy("calc").tokenizer
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                        n_positions=1024, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_probe_tells_gpt2_from_llama(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert tree_layout_problem(load_tiny_policy("calc").model) is None
    gpt2 = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g"))
    problem = tree_layout_problem(gpt2)
    assert problem is not None and "BlockMask" in problem


def test_gpt2_trains_in_the_paths_layout_with_a_note(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    ckpt = gpt2_checkpoint(tmp_path / "gpt2")
    cfg = load_config(None, {"env": "calc", "policy": f"hf:{ckpt}", "steps": 1,
                             "tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0,
                             "max_new_tokens": 8, "progress": False, "run_id": "g",
                             "store": str(tmp_path / "s"), "out": str(tmp_path / "run")})
    assert cfg.layout == "tree"
    train(cfg)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: this model cannot")]
    assert len(notes) == 1 and "training in the paths layout" in notes[0]
    metrics = read_metrics(cfg.store, "g")
    assert len(metrics["loss"]) == 1 and torch.isfinite(torch.tensor(metrics["loss"][0][1]))
