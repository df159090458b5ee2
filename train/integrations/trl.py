"""Log every group of a TRL ``GRPOTrainer`` run into a store, as one tree per group.

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), ...)
    TreeLoggerCallback("trees", run_id="run-1").attach(trainer)
    trainer.train()

Each training generation of the trainer (``GRPOTrainer._generate_and_score_completions``,
wrapped by ``attach``) gives B completions in blocks of ``num_generations`` G that share
one prompt (TRL's ``RepeatSampler``); each block is one tree of ``rollout_store.logger``:

* the root (node 0): the prompt's text (a conversational prompt rendered by the
  tokenizer, the messages kept in ``trees.meta.prompt``) and its token ids without
  padding;
* leaf i + 1: completion i's token ids (``completion_mask`` applied: up to and including
  EOS), its text (decoded, special tokens skipped, as TRL decodes it), the log pi of
  each sampled token and the entropy of each step's distribution, its reward
  r = nansum_j w_j r_j over the reward functions j with TRL's ``reward_weights`` w_j
  (each r_j a ``reward_parts`` entry named after the function; a function that
  returned None is left out and listed in the leaf's ``meta.missing_reward_parts``), and
  TRL's own advantage as a ``credits`` row of method ``source_advantage``;
* ``policy_version`` ``"{run_id}:step-{N}"``, N = ``state.global_step`` when the group
  was generated, i.e. the number of optimizer steps behind the weights that sampled it;
  the tree id ``"{run_id}-step{N:06d}-{k:04d}"`` (group k of that step), so a run
  resumed from a checkpoint re-logs a step under the same ids and the store keeps one
  copy.

Logprobs: TRL's sampling logprobs when it has them (vLLM: ``sampling_per_token_logps``;
``old_per_token_logps`` when generation and optimisation steps are misaligned), else one
no-grad forward of the policy on the batch with TRL's own
``_get_per_token_logps_and_entropies`` (logits divided by the sampling temperature, as
in TRL's loss), before the optimizer step that follows, so they are the sampling
policy's. Entropies come from that forward (none when TRL's logprobs are used).

Commits: the groups of a step are committed at ``on_step_end`` (one trees commit and one
credits commit) and whatever is left at ``on_train_end``. Evaluation generations are not
logged. Multi-process runs are refused at ``attach`` (each process holds only a slice of
a group's completions).

This reads private parts of ``GRPOTrainer`` (tested with trl 1.16.0; the ``trl`` extra
pins ``trl>=1.16,<2``): ``_generate_and_score_completions`` and ``_calculate_rewards``
(wrapped), ``_get_per_token_logps_and_entropies``, ``reward_func_names``,
``reward_weights``, ``num_generations``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rollout_store.logger import Step, TreeLogger
from rollout_store.store import Store


class TreeLoggerCallback(TrainerCallback):
    """A ``TrainerCallback`` that logs a ``GRPOTrainer``'s groups as trees (module
    docstring). ``store``: a ``Store`` or a path (created when missing)."""

    def __init__(self, store: Store | str | os.PathLike[str], run_id: str = "trl", *,
                 env: str = "trl") -> None:
        self.logger = TreeLogger(store, run_id, env=env, sampler="trl-grpo")
        self.run_id = run_id
        self.trainer: Any = None
        self._rewards: torch.Tensor | None = None
        self._step_groups: dict[int, int] = {}

    def attach(self, trainer: Any) -> TreeLoggerCallback:
        """Wrap ``trainer``'s generation and reward calls and register this callback."""
        if self.trainer is not None:
            raise RuntimeError("this TreeLoggerCallback is already attached to a trainer")
        for name in ("_generate_and_score_completions", "_calculate_rewards",
                     "_get_per_token_logps_and_entropies", "num_generations"):
            if not hasattr(trainer, name):
                raise TypeError(f"{type(trainer).__name__} has no {name}: TreeLoggerCallback "
                                "needs TRL's GRPOTrainer (trl>=1.16,<2)")
        if trainer.accelerator.num_processes > 1:
            raise ValueError("TreeLoggerCallback logs single-process runs only (each process "
                             "holds a slice of a group's completions)")
        generate, rewards = trainer._generate_and_score_completions, trainer._calculate_rewards

        def calculate_rewards(*args: Any, **kwargs: Any) -> torch.Tensor:
            self._rewards = rewards(*args, **kwargs)
            return self._rewards

        def generate_and_log(inputs: list[dict[str, Any]]) -> dict[str, Any]:
            self._rewards = None
            out = generate(inputs)
            if trainer.model.training:
                self._log(inputs, out)
            return out

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_log
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.trainer = trainer
        return self

    # ----- TrainerCallback ---------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if self.trainer is None:
            raise RuntimeError("TreeLoggerCallback was not attached: call "
                               "callback.attach(trainer) before trainer.train()")

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self.logger.flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.logger.flush()

    # ----- one generation ----------------------------------------------------------------

    def _log(self, inputs: list[dict[str, Any]], out: dict[str, Any]) -> None:
        t = self.trainer
        g = int(t.num_generations)
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]  # (B, P)
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]  # (B, C)
        b = completion_ids.size(0)
        if b % g or self._rewards is None or self._rewards.size(0) != b:
            raise RuntimeError(f"TreeLoggerCallback: a batch of {b} completions does not hold "
                               f"whole groups of {g} with their rewards")
        logps, entropies = self._logprobs(out)  # (B, C) each; entropies may be None
        advantages = out["advantages"].detach().float().cpu().tolist()  # (B,)
        rewards = self._rewards.detach().float().cpu()  # (B, n_funcs), NaN: not applicable
        weights = t.reward_weights.detach().float().cpu()  # (n_funcs,)
        names: Sequence[str] = list(t.reward_func_names)
        tok = t.processing_class
        tok = getattr(tok, "tokenizer", tok)  # a processor wraps its tokenizer
        step = int(t.state.global_step)
        version = f"{self.run_id}:step-{step}"
        for start in range(0, b, g):
            rows = range(start, start + g)
            p_ids = [prompt_ids[start][prompt_mask[start].bool()].tolist()]
            p_ids += [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in rows]
            if any(ids != p_ids[0] for ids in p_ids[1:]):
                raise RuntimeError(f"TreeLoggerCallback: completions {start}..{start + g - 1} "
                                   "do not share one prompt (groups must be contiguous)")
            prompt = inputs[start]["prompt"]
            text = prompt if isinstance(prompt, str) else tok.decode(
                p_ids[0], skip_special_tokens=False)
            steps = []
            for i in rows:
                keep = completion_mask[i].bool()
                ids = completion_ids[i][keep].tolist()
                parts = {n: float(rewards[i, j]) for j, n in enumerate(names)
                         if not torch.isnan(rewards[i, j])}
                missing = [n for n in names if n not in parts]
                reward = float(sum(float(weights[j]) * parts[n] for j, n in enumerate(names)
                                   if n in parts))
                steps.append(Step(
                    action=tok.decode(ids, skip_special_tokens=True), token_ids=ids,
                    logprobs=logps[i][keep].tolist(),
                    entropies=() if entropies is None else entropies[i][keep].tolist(),
                    reward=reward, reward_parts=parts, advantage=advantages[i], parent=None,
                    meta={"missing_reward_parts": missing} if missing else None))
            k = self._step_groups.get(step, 0)
            self._step_groups[step] = k + 1
            self.logger.tree(text, steps, prompt_token_ids=p_ids[0], policy_version=version,
                             tree_id=f"{self.run_id}-step{step:06d}-{k:04d}",
                             meta={"step": step, "num_generations": g,
                                   **({} if isinstance(prompt, str) else {"prompt": prompt})})

    def _logprobs(self, out: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, C) log pi of the sampled tokens and, when computed here, the entropies."""
        for key in ("sampling_per_token_logps", "old_per_token_logps"):
            if out.get(key) is not None:
                return out[key].detach().float().cpu(), None
        t = self.trainer
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, entropies, *_ = t._get_per_token_logps_and_entropies(
                t.model, ids, mask, out["completion_ids"].size(1), compute_entropy=True)
        return logps.float().cpu(), None if entropies is None else entropies.float().cpu()


__all__ = ["TreeLoggerCallback"]
