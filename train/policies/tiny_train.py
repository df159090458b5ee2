"""SFT cold start of the ``tiny`` policy on an environment's noisy expert traces.

``rtrees policy init --env SPEC [--seed S] [--out DIR] [--minutes M]`` calls
``init_policy``, for any environment with a scripted expert (``expert_action``; one
without gets a one-line ``ValueError`` before any data is made). The recipe
(``SFTConfig``; ``default_config`` lays the env's ``Environment.tiny_sft`` over its
defaults: calc, workflow and sgls declare the ones chosen from measurements on the
2-core machine):

1. Data. Held-out tasks are drawn first: ``eval_tasks`` for the stopping checks
   (seed ``1_000_000 + seed``) and ``test_tasks`` for the final report (seed
   ``2_000_000 + seed``). Training tasks come from ``generate_tasks(n, seed)`` with
   every prompt that occurs among the held-out tasks removed, so the reported success
   is on unseen tasks. Each training task gives one episode of the noisy expert,
   perturbed as the env's ``noise`` says (``ExpertNoise``; ``none``, the default: the
   expert's own actions): calc (``noisy_expert``) uses
   ``CalcEnv.noisy_expert_action(rng, p_error)`` (wrong operands, skipped tool, broken
   JSON, wrong answers, each followed by the expert's recovery); workflow
   (``random_valid``) replaces the optimal action (``WorkflowEnv.expert_action``, which
   knows the hidden tool probabilities) with a uniformly random valid action with
   probability ``p_error`` (0.2); sgls (``detour``) plays ``SglsEnv.expert_action`` (the
   task's gold calls, then the reference reply) and with probability ``p_error`` (0.15)
   per step, at most once per episode, takes a detour first (``sgls_detour``: a read-only
   call on an id of the world, ``view_cart``, or the expert's call with its JSON broken),
   which costs one of
   the task's three spare steps and changes no effect. The default task mix of the
   environment is used (calc: 1-2 operations; workflow: horizons 6, 9, 12; sgls: the
   shop and flight worlds alternating, every task kind) unless ``task_params`` (``policy
   init --task-param``, e.g. calc ``one_op=true``) set the generator's options for every
   split; such a policy is written to ``--out`` only, never the default cache.
2. Loss. Episodes are rendered with ``tiny.render_segments`` and tokenized; the loss
   is the mean next-token cross-entropy over ACTION tokens only: prompt,
   observations (tool responses) and role markers are masked out. sgls, like workflow,
   trains on the expert's own actions only (the detours are not imitated). calc trains on
   its mistakes too (``train_on_mistakes``): imitating the noisy expert keeps the
   policy's own error rate, and its traces show recoveries. workflow trains on the
   expert's own actions only: the noise shows the states that mistakes lead to
   (DART-style noise injection), which taught "broken -> repair" reliably where
   imitating the mistakes did not.
3. Start. Random weights (``init_model``, seeded), or with ``init_from`` (sgls: calc)
   the committed checkpoint of another env with the vocabulary grown
   (``tiny.warm_start_model``): the calc policy already copies digits from its context,
   which sgls needs for every id and amount.
4. Optimisation. AdamW (lr ``lr``, betas (0.9, 0.95), weight decay 0.01), linear
   warmup then cosine decay to 10% over ``max_steps``, gradient clipping at 1.0,
   batches of about ``batch_tokens`` padded tokens drawn from length buckets,
   fp32, ``torch.set_num_threads(threads)``.
5. Stopping. Every ``eval_every`` optimizer steps the SAMPLED success rate
   (temperature 1, one rollout per task) on the ``eval_tasks`` is measured; training
   stops at the first check inside ``stop_band``, at ``max_steps``, or when the
   ``minutes`` budget (data, optimisation and checks together) would be exceeded.
   Because the checks count steps, a seeded run is reproducible unless the time cap
   cuts it short.
6. Report. The final weights are evaluated on ``test_tasks`` (sampled, temperature 1),
   per group of the env's ``task_group_key`` (calc: difficulty, the number of
   operations; workflow: horizon; sgls: task kind), and saved
   with ``tiny.save_checkpoint`` together with the config and these numbers.

The target is a policy that succeeds sometimes, not always (20-80%): a group of
rollouts that all succeed or all fail carries no learning signal for GRPO-style
credit.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from train.envs import Environment, Task, env_class
from train.envs.base import task_identity
from train.envs.sgls import SglsEnv
from train.policies.base import Policy, Transcript, Turn
from train.policies.errors import PolicyUnavailableError
from train.policies.hf import HFPolicy, weights_version
from train.policies.tiny import (
    COMMITTED_DIR,
    build_tokenizer,
    default_cache_dir,
    find_checkpoint,
    init_model,
    n_parameters,
    render_segments,
    save_checkpoint,
    shape_dict,
    warm_start_model,
)

ExpertNoise = Literal["none", "noisy_expert", "random_valid", "detour"]
"""How ``expert_episode`` perturbs the scripted expert with probability ``p_error``:
``none``, its own actions only; ``noisy_expert``, the env's
``noisy_expert_action(rng, p_error)`` (calc); ``random_valid``, a uniformly random one of
the env's ``valid_actions()`` (workflow); ``detour``, at most one harmless read-only or
malformed call per episode (``sgls_detour``: the sgls worlds)."""
EXPERT_NOISE: tuple[str, ...] = ("none", "noisy_expert", "random_valid", "detour")
Log = Callable[[str], None]

EVAL_SEED_OFFSET = 1_000_000
TEST_SEED_OFFSET = 2_000_000


@dataclass(frozen=True)
class SFTConfig:
    """One ``policy init`` run. Defaults per environment come from ``default_config``."""

    env: str
    """Environment (a spec: ``train.envs.make_env``) whose default task mix is trained and
    evaluated; it needs a scripted expert (``expert_action``)."""
    seed: int = 0
    """Seeds the model initialisation, the training tasks, the noise and batch order."""
    minutes: float = 10.0
    """Wall-clock budget for data, optimisation and the stopping checks."""
    max_steps: int = 4000
    """Optimizer steps at most (also the length of the cosine schedule)."""
    train_tasks: int = 40_000
    """Training episodes generated (one noisy-expert episode per task)."""
    batch_tokens: int = 2048
    """Padded tokens per batch (about 2k learned within the minutes budget on 2 cores when
    this policy was tuned)."""
    lr: float = 3e-3
    """Peak learning rate (3e-3 for the 0.8M-parameter model, found when it was tuned)."""
    warmup_steps: int = 100
    p_error: float = 0.1
    """Probability that the expert's action is replaced by a mistake."""
    train_on_mistakes: bool = True
    """Whether the mistakes carry a loss too. True imitates the noisy expert, mistakes
    and recoveries alike; False trains on the expert's own actions only, the noise
    serving to show the states that mistakes lead to (DART-style noise injection)."""
    eval_every: int = 250
    """Optimizer steps between stopping checks."""
    eval_tasks: int = 200
    """Held-out tasks of each stopping check."""
    test_tasks: int = 600
    """Held-out tasks of the final report."""
    stop_band: tuple[float, float] = (0.35, 0.75)
    """Training stops at the first check whose success lies in this band (inside the
    20-80% target, with a margin for the check's sampling error)."""
    max_new_tokens: int = 48
    """Token cap of one sampled step during evaluation."""
    threads: int = 2
    """Torch threads, capped at the CPUs this process may run on (``os.sched_getaffinity``,
    e.g. under ``taskset``): more threads than CPUs oversubscribe them and run many times
    slower."""
    task_params: dict[str, Any] = field(default_factory=dict)
    """Options of the env's task generator for training, check and test tasks
    (``generate_tasks(n, seed, **task_params)``), e.g. calc ``one_op=True``."""
    noise: ExpertNoise = "none"
    """How the expert's actions are perturbed (``ExpertNoise``; the env's ``tiny_sft`` names
    its own)."""
    init_from: str | None = None
    """Start from this env's seed-0 tiny checkpoint (``find_checkpoint``: the cached one,
    else the committed one; its path and version go into the new checkpoint's record)
    instead of random weights; its vocabulary must be a prefix of this env's
    (``tiny.warm_start_model``)."""

    def __post_init__(self) -> None:
        require_expert(self.env)
        if self.init_from is not None:
            env_class(self.init_from)  # EnvSpecError (a ValueError) naming the spec
        if self.noise not in EXPERT_NOISE:
            raise ValueError(f"noise must be one of {', '.join(EXPERT_NOISE)}, "
                             f"got {self.noise!r}")
        if self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if not 0.0 <= self.p_error < 1.0:
            raise ValueError(f"p_error must lie in [0, 1), got {self.p_error}")
        low, high = self.stop_band
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"stop_band must be 0 <= low <= high <= 1, got {self.stop_band}")
        for name in ("max_steps", "train_tasks", "batch_tokens", "eval_every", "eval_tasks",
                     "test_tasks", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def require_expert(env: str) -> type[Environment]:
    """The class of ``env`` (a spec), which must have a scripted expert: ``EnvSpecError``
    for a spec that does not resolve, else a one-line ``ValueError`` naming what is
    missing (``policy init`` imitates the expert)."""
    cls = env_class(env)
    if cls.expert_action is Environment.expert_action:
        raise ValueError(f"environment {env!r} ({cls.__name__}) has no scripted expert: "
                         f"`rtrees policy init` imitates one; implement "
                         f"{cls.__name__}.expert_action()")
    return cls


def default_config(env: str, seed: int = 0, minutes: float | None = None, **overrides: Any
                   ) -> SFTConfig:
    """``env``'s recipe: its class's ``tiny_sft`` (the measured defaults of calc, workflow
    and sgls: module docstring) over ``SFTConfig``'s defaults, then
    ``overrides``; ``minutes`` None takes the recipe's budget (``default_minutes``)."""
    options = {**require_expert(env).tiny_sft, **overrides}
    if minutes is not None:
        options["minutes"] = minutes
    return SFTConfig(env=env, seed=seed, **options)


def default_minutes(env: str) -> float:
    """The wall-clock budget of ``policy init`` for ``env`` when ``--minutes`` is not given
    (sgls: 40, for its 6,000 steps of ~20 min on one quiet core; the rest: 10)."""
    return float(env_class(env).tiny_sft.get("minutes", SFTConfig.minutes))


# ---------------------------------------------------------------------------
# Data


def make_tasks(env: str, n: int, seed: int, **task_params: Any) -> list[Task]:
    """``n`` tasks of ``env`` (a spec), seeded: the default mix, or the generator's options
    ``task_params``."""
    return env_class(env).generate_tasks(n, seed, **task_params)


@dataclass(frozen=True)
class Episode:
    """A noisy-expert episode: its turns, and for each action whether it was a mistake
    (the noise) rather than the expert's own action."""

    turns: list[Turn]
    mistakes: list[bool]


def sgls_detour(env: SglsEnv, rng: random.Random) -> str:
    """A mistake that costs a step but no effect: a read-only call on an id of the
    world (``get_item`` / ``get_flight``), ``view_cart``, or the expert's next call with
    its JSON broken (answered by an error). The expert's recovery follows it."""
    state = json.loads(env.snapshot())
    kind = rng.randrange(3)
    expert = env.expert_action()
    if kind == 0 and expert.startswith("<tool_call>"):
        return expert.replace("}}</tool_call>", "}</tool_call>", 1)
    if state["task"]["world"] == "shop":
        if kind == 1:
            return '<tool_call>{"name": "view_cart", "arguments": {}}</tool_call>'
        item = rng.choice(sorted(state["world"]["items"]))
        return f'<tool_call>{{"name": "get_item", "arguments": {{"item_id": "{item}"}}}}' \
               "</tool_call>"
    flight = rng.choice(sorted(state["world"]["flights"]))
    return f'<tool_call>{{"name": "get_flight", "arguments": {{"flight_id": "{flight}"}}}}' \
           "</tool_call>"


def expert_episode(env_name: str, task: Task, rng: random.Random, p_error: float,
                   noise: ExpertNoise | None = None) -> Episode:
    """One episode of the noisy expert (prompt, action, observation, ...) in a fresh
    instance of ``env_name`` (a spec); ``noise`` None takes the env's recipe's
    (``default_config``)."""
    if noise is None:
        noise = default_config(env_name).noise
    env: Any = env_class(env_name)()  # noisy_expert_action / valid_actions: per ``noise``
    turns: list[Turn] = [("prompt", env.reset(task))]
    mistakes: list[bool] = []
    while True:
        expert = env.expert_action()
        if noise == "noisy_expert":
            action = env.noisy_expert_action(rng, p_error)
        elif noise == "detour":
            # at most one detour per episode: the step budget has 3 spare steps
            detour = rng.random() < p_error and not any(mistakes)
            action = sgls_detour(env, rng) if detour else expert
        elif noise == "random_valid":
            action = rng.choice(env.valid_actions()) if rng.random() < p_error else expert
        else:
            action = expert
        result = env.step(action)
        turns += [("action", action), ("observation", result.observation)]
        mistakes.append(action != expert)
        if result.done:
            return Episode(turns, mistakes)


def encode_episode(tokenizer: Any, turns: Transcript,
                   trained: Sequence[bool] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered episode and, per token, whether it carries a loss: the
    tokens of the actions (of those with ``trained[k]`` True, when given)."""
    ids: list[int] = []
    has_loss: list[bool] = []
    k = 0
    for text, is_action in render_segments(turns):
        piece: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        loss = is_action and (trained is None or trained[k])
        has_loss += [loss] * len(piece)
        k += is_action
    return ids, has_loss


@dataclass
class Dataset:
    """Tokenized episodes and a seeded bucketed batch sampler."""

    ids: list[list[int]]
    targets: list[list[bool]]
    batch_tokens: int
    rng: random.Random
    _queue: list[list[int]] = field(default_factory=list)

    def _refill(self) -> None:
        """One pass over the data: shuffle, sort windows of ~100 batches by length,
        cut into batches of <= batch_tokens padded tokens, shuffle the batches."""
        order = list(range(len(self.ids)))
        self.rng.shuffle(order)
        mean_len = sum(len(x) for x in self.ids) / len(self.ids)
        window = max(1, int(100 * self.batch_tokens / mean_len))
        batches: list[list[int]] = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda i: len(self.ids[i]))
            batch: list[int] = []
            for i in chunk:
                if batch and (len(batch) + 1) * len(self.ids[i]) > self.batch_tokens:
                    batches.append(batch)
                    batch = []
                batch.append(i)
            if batch:
                batches.append(batch)
        self.rng.shuffle(batches)
        self._queue = batches

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, attention mask, loss mask), each (B, T), right-padded."""
        if not self._queue:
            self._refill()
        batch = self._queue.pop()
        width = max(len(self.ids[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        loss_mask = torch.zeros((len(batch), width), dtype=torch.bool)
        for b, i in enumerate(batch):
            n = len(self.ids[i])
            ids[b, :n] = torch.tensor(self.ids[i])
            attention[b, :n] = 1
            loss_mask[b, :n] = torch.tensor(self.targets[i])
        return ids, attention, loss_mask


def build_dataset(config: SFTConfig, tokenizer: Any, exclude: set[tuple[str, str]]
                  ) -> Dataset:
    """The expert's episodes on ``config.train_tasks`` tasks, minus those whose
    ``task_identity`` is in ``exclude`` (the held-out tasks)."""
    tasks = [t for t in make_tasks(config.env, config.train_tasks, config.seed,
                                   **config.task_params)
             if task_identity(t) not in exclude]
    rng = random.Random(config.seed)
    ids, targets = [], []
    for task in tasks:
        episode = expert_episode(config.env, task, rng, config.p_error, config.noise)
        trained = None if config.train_on_mistakes else [not m for m in episode.mistakes]
        episode_ids, has_loss = encode_episode(tokenizer, episode.turns, trained)
        ids.append(episode_ids)
        targets.append(has_loss)
    return Dataset(ids, targets, config.batch_tokens, random.Random(config.seed + 1))


# ---------------------------------------------------------------------------
# Evaluation


class HeldOutReport(Protocol):
    """Sampled success on a task set (``train.sampling.evaluation.SuccessReport``)."""

    @property
    def per_group(self) -> dict[int | str, tuple[int, int]]:
        """group -> (successes, tasks)."""
        ...

    @property
    def overall(self) -> float: ...

    def lines(self) -> list[str]: ...

    def to_json(self) -> dict[str, Any]: ...


class Evaluate(Protocol):
    """The held-out check of SFT (``train.sampling.evaluation.success_report``): passed
    in by the caller, so this module, below the samplers, imports nothing of
    ``train.sampling`` (issue 28: the policies -> sampling circle)."""

    def __call__(self, policy: Policy, env_name: str, tasks: Sequence[Task], seed: int,
                 max_new_tokens: int = 48) -> HeldOutReport: ...


# ---------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class SFTResult:
    """What ``train_sft`` did and where the checkpoint lies."""

    path: Path
    steps: int
    train_seconds: float
    stop_reason: str
    checks: list[tuple[int, float]]  # (step, held-out success) of each stopping check
    test: HeldOutReport
    parameters: int


def _lr_at(step: int, config: SFTConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps
                                                             - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_sft(config: SFTConfig, out: Path, evaluate: Evaluate, log: Log = print
              ) -> SFTResult:
    """Train a tiny policy from scratch by SFT and save it to ``out`` (module docstring);
    ``evaluate`` measures the held-out success (the stopping checks and the report)."""
    start = time.perf_counter()
    deadline = start + config.minutes * 60.0
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(config.threads, len(os.sched_getaffinity(0)))))
    try:
        return _train(config, out, evaluate, log, start, deadline)
    finally:
        torch.set_num_threads(threads_before)


def _train(config: SFTConfig, out: Path, evaluate: Evaluate, log: Log, start: float,
           deadline: float) -> SFTResult:
    tokenizer = build_tokenizer(config.env)
    source = None
    if config.init_from is None:
        model = init_model(tokenizer, seed=config.seed)
    else:
        source = find_checkpoint(config.init_from, 0)
        if source is None:
            raise PolicyUnavailableError(
                f"{config.env} training starts from the tiny {config.init_from} policy, "
                f"and there is none: run `rtrees policy init --env {config.init_from}`")
        model = warm_start_model(tokenizer, source, seed=config.seed)
        log(f"starting from the {config.init_from} policy at {source}")
    eval_tasks = make_tasks(config.env, config.eval_tasks, EVAL_SEED_OFFSET + config.seed,
                            **config.task_params)
    test_tasks = make_tasks(config.env, config.test_tasks, TEST_SEED_OFFSET + config.seed,
                            **config.task_params)
    data = build_dataset(config, tokenizer, {task_identity(t) for t in (*eval_tasks, *test_tasks)})
    if not data.ids:
        raise ValueError(f"{config.env}: none of the {config.train_tasks} training tasks is "
                         "left once the held-out tasks (same prompt and config) are removed; "
                         "generate_tasks must vary its tasks with the seed")
    log(f"{config.env}: {len(data.ids):,} noisy-expert episodes "
        f"({sum(map(len, data.ids)):,} tokens, {sum(map(sum, data.targets)):,} action "
        f"tokens), model {n_parameters(model):,} parameters, "
        f"data took {time.perf_counter() - start:.0f} s")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    policy = HFPolicy(model, tokenizer, max_batch=256)
    checks: list[tuple[int, float]] = []
    step, reason = 0, "max_steps"
    last_check_seconds = 0.0
    loss_sum, loss_n = 0.0, 0
    while step < config.max_steps:
        model.train()
        ids, attention, loss_mask = data.next_batch()
        logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
        # token t+1 is predicted at position t; only action tokens carry a loss
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        target_mask = loss_mask[:, 1:].flatten().float()
        loss = (token_loss * target_mask).sum() / target_mask.sum().clamp(min=1.0)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
        if step % config.eval_every == 0:
            model.eval()
            t0 = time.perf_counter()
            rate = evaluate(policy, config.env, eval_tasks, seed=config.seed + step,
                                  max_new_tokens=config.max_new_tokens).overall
            last_check_seconds = time.perf_counter() - t0
            checks.append((step, rate))
            log(f"step {step:5d}  loss {loss_sum / loss_n:.3f}  held-out success {rate:6.1%}  "
                f"({time.perf_counter() - start:.0f} s)")
            loss_sum, loss_n = 0.0, 0
            if config.stop_band[0] <= rate <= config.stop_band[1]:
                reason = "in band"
                break
        seconds_per_step = (time.perf_counter() - start) / step
        if time.perf_counter() + seconds_per_step + last_check_seconds > deadline:
            reason = "time budget"
            break
    train_seconds = time.perf_counter() - start
    model.eval()
    log(f"stopped after {step} steps ({reason}), {train_seconds:.0f} s; "
        f"evaluating on {len(test_tasks)} held-out tasks")
    test = evaluate(policy, config.env, test_tasks, seed=TEST_SEED_OFFSET + config.seed,
                          max_new_tokens=config.max_new_tokens)
    meta = {
        "env": config.env, "seed": config.seed, "config": asdict(config),
        "model": shape_dict(), "parameters": n_parameters(model), "steps": step,
        "train_seconds": round(train_seconds, 1), "stop_reason": reason,
        "checks": [{"step": s, "success": r} for s, r in checks],
        "test": test.to_json(), "test_tasks_seed": TEST_SEED_OFFSET + config.seed,
        "init_from": None if source is None else {
            "env": config.init_from, "path": _repo_relative(source),
            "policy_version": weights_version(source)},
        "command": f"rtrees policy init --env {config.env} --seed {config.seed}",
    }
    path = save_checkpoint(model, tokenizer, out, meta)
    return SFTResult(path, step, train_seconds, reason, checks, test, n_parameters(model))


def _repo_relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (a committed checkpoint)."""
    root = COMMITTED_DIR.resolve().parents[2]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def init_policy(env: str, seed: int = 0, out: Path | None = None, minutes: float | None = None,
                force: bool = False, log: Log = print, *, evaluate: Evaluate,
                **overrides: Any) -> SFTResult | None:
    """``rtrees policy init``: train into ``out`` (default: the cache directory) unless a
    checkpoint is already there (``force`` retrains). Returns None when one was reused.
    ``evaluate``: the held-out success check (``train_sft``)."""
    if overrides.get("task_params") and out is None:
        raise ValueError("a policy of other task options (--task-param) needs --out: the "
                         "default cache holds the default-mix policy every run finds")
    config = default_config(env, seed=seed, minutes=minutes, **overrides)
    target = Path(out) if out is not None else default_cache_dir(env, seed)
    try:  # a bad option is named before any data is generated
        make_tasks(env, 1, seed, **config.task_params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--task-param: {exc}") from None
    if not force:
        from train.policies.tiny import is_checkpoint

        found = target if is_checkpoint(target) else (find_checkpoint(env, seed)
                                                      if out is None else None)
        if found is not None:
            log(f"reusing the checkpoint at {found} (--force retrains)")
            return None
    try:  # the checkpoint is written beside ``target``: fail before minutes of training
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write the checkpoint to {target}: "
                         f"{exc.strerror or exc}") from None
    return train_sft(config, target, evaluate, log)
