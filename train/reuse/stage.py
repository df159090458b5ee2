"""The reuse stage: the one object the trainer calls (docs/METHODS.md section 9).

``make_reuse(config, credit_for, credit_key)`` is None for ``reuse none``, else a
``ReuseStage`` for the rule of ``train.reuse.resolve.RULES``, with every field of the run it
reads bound once (``RunBinding``: env, run id, seed, run directory, layout, sizes,
temperature, the run's credit). Per iteration, ``ReuseStage.step`` takes the stored trees
(``train.reuse.select``), scores their actions under the pre-update weights (D3; not for a
rule with ``prox="interp"``, P1), resolves their comparisons by the rule, refreshes and
commits what the rule refreshes, commits the stored trees' credit under
``{credit}+{suffix}`` with the *current* policy version, and returns the sequences, credit,
pi_prox and metrics to train on (``StoredBatch``). In the loss step,
``ReuseStage.weight`` gives each token's behaviour weight (G8, or M2PO's mask M1, or the
interpolated pi_prox of P1), reading which tokens are stored from the micro-batch
(``MicroBatch.stored``), and counts its statistics for ``ReuseStage.loss_metrics``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rollout_store.store import Store, now_utc
from rollout_store.tree import Tree
from train.batches import MicroBatch, NodeCredit, ProxLogp, rows_credit
from train.credit.store_io import complete_credit, stored_credit
from train.envs import make_env
from train.loss import ISMode, behaviour_weight
from train.policies.base import Policy
from train.reuse.calibrate import gate_params
from train.reuse.params import ReuseError, ReuseParams
from train.reuse.refresh import refresh_trees
from train.reuse.resolve import DECISIONS, Rule, get_rule, resolve_tree, tool_steps, with_returns
from train.reuse.runfiles import log_line, read_record, write_params
from train.reuse.score import score_actions
from train.reuse.select import SKIP_REASONS, Selection, check_reuse, refuse_thin, select_stored
from train.sampling.base import mix_seed
from train.sampling.engine import EnvSource
from train.sequences import TreeSeqs, build_sequences

CreditFor = Callable[[Sequence[Tree]], tuple[pa.Table, dict[tuple[str, int], NodeCredit]]]
"""The trainer's credit: trees -> (credit rows to commit, per-node token credit)."""


@dataclass
class StoredStep:
    """One iteration's stored trees after resolution: ``credited`` (copies carrying the
    rule's returns, for the credit estimator), ``refreshed`` (new trees to commit), pair
    decisions per ``DECISIONS`` and the new tool steps the refreshes (and a D7
    calibration, when one ran) spent."""

    credited: list[Tree]
    refreshed: list[Tree]
    pairs: Counter[str]
    new_tool_steps: int
    calibration_tool_steps: int = 0
    """Of ``new_tool_steps``, those the D7 calibration draws spent (0 but once)."""
    feasible_pairs: int = 0
    """Pairs whose stored data could resolve their gap (``resolve.feasible_pairs``)."""


def resolve_stored(sel: Selection, rule: Rule | str, prox: ProxLogp, params: ReuseParams,
                   env: EnvSource, policy: Policy, *, run_id: str, iteration: int,
                   seed: int, max_new_tokens: int, temperature: float,
                   log: Path | None = None) -> StoredStep:
    """``resolve_tree`` for every selected tree, then ``refresh_trees`` over all of them
    (one wavefront of the engine; ``env``: an environment factory, or one environment
    for the trees in turn), returns composed with the protocol's posterior means.
    Refresh tree ids are ``RUN/itNNNNNN/refresh/JJJ``; draws are seeded by (seed,
    "refresh", iteration) and the stored tree's id. With
    a calibrating rule (``dsc``) the gate's params come from ``gate_params`` (the D7
    calibration lives in ``log``'s directory, the run's OUT)."""
    step = StoredStep([], [], Counter(), 0)
    calibrated = False
    rule = get_rule(rule)
    if rule.calibrates:
        params, spent, record = gate_params(
            sel, params, env, policy, out=None if log is None else log.parent,
            iteration=iteration, seed=seed, max_new_tokens=max_new_tokens,
            temperature=temperature)
        step.new_tool_steps += spent
        step.calibration_tool_steps = spent
        if log is not None and record is not None:
            log_line(log, {"iteration": iteration, "calibration": record})
        done = read_record(log.parent).get("calibration") if log is not None else None
        calibrated = isinstance(done, dict) and done.get("status") == "calibrated"
    resolved = [resolve_tree(old, rule, prox, params) for old in sel.trees]
    refreshed = refresh_trees(
        [(old, res, f"{run_id}/it{iteration:06d}/refresh/{j:03d}")
         for j, (old, res) in enumerate(zip(sel.trees, resolved, strict=True))],
        env, policy, run_id=run_id, seed=mix_seed(seed, "refresh", iteration), params=params,
        max_new_tokens=max_new_tokens, temperature=temperature)
    for old, stale, res, got in zip(sel.trees, sel.staleness, resolved, refreshed, strict=True):
        step.pairs.update(res.pairs)
        step.feasible_pairs += res.feasible
        returns = res.compose(got.posterior)
        step.credited.append(with_returns(old, returns))
        step.new_tool_steps += got.steps
        if got.tree is not None:
            step.refreshed.append(got.tree)
        if log is not None:
            values = {str(r): float(np.mean([v for x, v in returns.items()
                                             if res.route_of[x] == r]))
                      for r in sorted(set(res.route_of.values()))}
            record = {"iteration": iteration, "tree_id": old.tree_id, "staleness": stale,
                      "pairs": dict(res.pairs), "refresh": res.refresh,
                      "refreshed_nodes": sorted({n for n, _ in got.posterior}),
                      "refresh_no_snapshot": got.no_snapshot, "refresh_steps": got.steps,
                      "route_values": values, "mode": rule.name}
            if rule.calibrates:
                record.update({"kappas": params.kappas(), "calibrated": calibrated})
            log_line(log, record)
    return step


def rename_method(rows: pa.Table, suffix: str, policy_version: str) -> pa.Table:
    """``credits`` rows with method ``METHOD+suffix`` and the current policy version."""
    n = rows.num_rows
    methods = [f"{m}+{suffix}" for m in rows.column("method").to_pylist()]
    i, j = rows.schema.get_field_index("method"), rows.schema.get_field_index("policy_version")
    rows = rows.set_column(i, rows.schema.field(i), pa.array(methods, pa.string()))
    return rows.set_column(j, rows.schema.field(j), pa.array([policy_version] * n, pa.string()))




def same_data(a: Tree, b: Tree) -> bool:
    """``b`` (a ``with_returns`` copy of ``a``) carries ``a``'s rewards at every node, so
    its credit is ``a``'s stored credit (credit is a function of the stored data)."""
    return len(a.nodes) == len(b.nodes) and all(
        x.node_id == y.node_id and x.reward == y.reward
        for x, y in zip(a.nodes, b.nodes, strict=True))


def credit_stored(store: Store, stored: Sequence[Tree], credited: Sequence[Tree],
                  credit_for: CreditFor, key: tuple[str, str] | None, run_id: str
                  ) -> tuple[pa.Table | None, dict[tuple[str, int], NodeCredit], int]:
    """Credit rows and token credit of the stored trees as resolved (``credited``, one per
    ``stored`` tree), and how many trees' credit was read rather than computed: a tree the
    rule left unchanged (``same_data``) whose committed rows under ``key`` (method, params
    hash; ``stored_credit``) cover every node with their clip bounds is read back (rows
    relabelled with ``run_id``); every other tree, among them a stored tree without
    credit rows for the method, is credited by ``credit_for``. So the estimator runs once
    per tree: at its iteration, not again each time the tree is reused."""
    if not credited:
        return None, {}, 0
    read: set[str] = set()
    rows = None
    if key is not None:
        same = [c for s, c in zip(stored, credited, strict=True) if same_data(s, c)]
        found = stored_credit(store, [t.tree_id for t in same], *key)
        read = complete_credit(found, same)
        if read:
            found = found.filter(pc.is_in(found.column("tree_id"),
                                          value_set=pa.array(sorted(read), pa.string())))
            n = found.num_rows
            found = found.set_column(found.schema.get_field_index("run_id"),
                                     found.schema.field("run_id"),
                                     pa.array([run_id] * n, pa.string()))
            rows = found.set_column(found.schema.get_field_index("created_at"),
                                    found.schema.field("created_at"),
                                    pa.array([now_utc()] * n, found.schema.field(
                                        "created_at").type))
    todo = [t for t in credited if t.tree_id not in read]
    credit = {} if rows is None else rows_credit(rows)
    if todo:
        new_rows, new_credit = credit_for(todo)
        credit.update(new_credit)
        rows = new_rows if rows is None else pa.concat_tables([new_rows, rows])
    return rows, credit, len(read)


def m2po_mask(log_ratio: torch.Tensor, threshold: float) -> torch.Tensor:
    """(M1) (K,) bool, True for the tokens kept: drop the tokens with the largest
    (log pi_prox - log mu)^2 until the mean of the rest is at most ``threshold`` (the
    fewest tokens dropped that do it; none when the mean already is)."""
    sq = log_ratio.double() ** 2
    keep = torch.ones_like(sq, dtype=torch.bool)
    if not sq.numel():
        return keep
    order = torch.argsort(sq, descending=True, stable=True)
    ranked = sq[order]
    n = ranked.numel()
    # mean of the tokens left after dropping the first j: suffix sums over n - j
    suffix = torch.flip(torch.cumsum(torch.flip(ranked, [0]), 0), [0])  # (n,) sum of j..n-1
    counts = torch.arange(n, 0, -1, dtype=torch.float64)
    ok = torch.nonzero(suffix / counts <= threshold).flatten()
    drop = int(ok[0]) if ok.numel() else n
    keep[order[:drop]] = False
    return keep


def interp_prox(behav_logp: torch.Tensor, logp: torch.Tensor,
                staleness: torch.Tensor) -> torch.Tensor:
    """(P1, A-3PO) log pi_prox ~ log mu + alpha (log pi_theta - log mu), alpha = s / (s + 1)
    for a token of staleness s (versions behind; s = 0: alpha = 0, pi_prox = mu), with
    log pi_theta the training forward's logprobs (detached): no extra forward pass."""
    alpha = staleness / (staleness + 1.0)
    return behav_logp + alpha * (logp.detach() - behav_logp)


@dataclass(frozen=True)
class RunBinding:
    """The run's fields that ``ReuseStage.step`` reads, bound once by ``make_reuse``."""

    env: EnvSource
    """An environment factory of the run's env (``make_env``)."""
    env_name: str
    run_id: str
    seed: int
    out: Path
    """The run directory (``reuse.jsonl``, the D7 calibration record)."""
    layout: Any
    micro_tokens: int
    row_tokens: int | None
    max_new_tokens: int
    temperature: float
    credit_for: CreditFor
    credit_key: tuple[str, str] | None


@dataclass
class StoredBatch:
    """What one iteration's stored trees add to the batch: trees (stored, then refreshed)
    and their sequences, token credit, log pi_prox, staleness per tree id and metrics."""

    trees: list[Tree]
    seqs: list[TreeSeqs]
    credit: dict[tuple[str, int], NodeCredit]
    prox: dict[tuple[str, int], np.ndarray]
    staleness: dict[str, int]
    metrics: dict[str, float]


@dataclass
class ReuseStage:
    """Stored-tree reuse under one ``rule`` (module docstring)."""

    rule: Rule
    params: ReuseParams
    reuse_from: str
    per_step: int
    max_staleness: int
    is_cap: float
    is_mode: ISMode
    run: RunBinding | None = None
    """What ``step`` needs of the run besides the iteration's data (``make_reuse``)."""
    _w: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("sum", "over", "tokens", "masked"), 0.0))

    @property
    def stored_passes(self) -> int:
        """U1: optimizer passes over the stored trees per fresh iteration."""
        return self.params.stored_passes

    def check_params(self) -> None:
        """Refuse (``ReuseError``) a calibrating rule's D7 calibration with too few trees to
        certify its level: the check that needs no store, run before one is created."""
        problem = self.params.calibration_problem() if self.rule.calibrates else None
        if problem is not None:
            raise ReuseError(f"reuse {self.rule.name}: {problem}")

    def check(self, store: Store, run_id: str) -> None:
        """Refuse before training (``ReuseError``) what ``check_params`` refuses, or a bad
        ``reuse_from`` over ``store``."""
        self.check_params()
        check_reuse(store, self.reuse_from, run_id)

    def start(self, out: Path) -> None:
        """Record the knobs (and a pending or kept D7 calibration) in the run directory."""
        write_params(out, self.params)

    def step(self, store: Store, model: Any, policy: Any, it: int,
             key: Callable[[str], str] | None = None,
             rename: Callable[[list[Tree]], list[Tree]] | None = None) -> StoredBatch:
        """Iteration ``it``'s stored trees: select, score under ``model`` (the weights
        before the update; ``policy`` their published policy), resolve, refresh, commit
        their credit (module docstring); the run's env, seed, layout, sizes and credit are
        bound at ``make_reuse`` (``RunBinding``). ``key(name)``: the commit key of this
        iteration's ``name`` rows (default ``RUN:name:it``); ``rename``: applied to
        refreshed trees before they are committed (the trainer's retry of a differing
        replay)."""
        r = self._run()
        sel = select_stored(store, reuse_from=self.reuse_from, run_id=r.run_id, env=r.env_name,
                            iteration=it, max_staleness=self.max_staleness,
                            per_step=self.per_step, seed=r.seed,
                            need_snapshots=self.rule.needs_snapshots,
                            tokenizer_dir=policy.policy_ref)
        if self.rule.gated:
            sel = refuse_thin(sel, self.params.min_trajectories, rule=self.rule.name,
                              iteration=it)
        return self._after_select(sel, store, model, policy, it, key, rename)

    def _run(self) -> RunBinding:
        if self.run is None:
            raise ReuseError("this reuse stage is not bound to a run (make_reuse)")
        return self.run

    def _after_select(self, sel: Selection, store: Store, model: Any, policy: Any, it: int,
                      key: Callable[[str], str] | None = None,
                      rename: Callable[[list[Tree]], list[Tree]] | None = None
                      ) -> StoredBatch:
        r = self._run()
        run_id, layout, micro_tokens, row_tokens = r.run_id, r.layout, r.micro_tokens, \
            r.row_tokens

        def commit_key(name: str) -> str:
            return key(name) if key is not None else f"{run_id}:{name}:{it}"

        old_seqs = [build_sequences(t, policy.prompt_ids) for t in sel.trees]
        metrics: dict[str, float] = {}
        if self.rule.prox == "forward":
            prox = score_actions(model, old_seqs, layout, micro_tokens, policy.pad_id,
                                 row_tokens)
        else:  # P1: no forward; pi_prox = mu for the resolution (every rule of P1 reuses)
            prox = {(ts.tree_id, n.node_id): np.asarray(n.old_logp, np.float64)
                    for ts in old_seqs for n in ts.nodes}
            metrics["reuse_prox_forward_tokens_saved"] = float(
                sum(len(n.full) for ts in old_seqs for n in ts.nodes))
        step = resolve_stored(sel, self.rule, prox, self.params, r.env, policy, run_id=run_id,
                              iteration=it, seed=r.seed, max_new_tokens=r.max_new_tokens,
                              temperature=r.temperature, log=r.out / "reuse.jsonl")
        refreshed = step.refreshed
        if refreshed and rename is not None:
            refreshed = rename(refreshed)
        if refreshed:
            store.append_trees(refreshed, key=commit_key("refresh-trees"))
        old_rows, old_credit, read = credit_stored(store, sel.trees, step.credited,
                                                   r.credit_for, r.credit_key, run_id)
        new_rows, new_credit = r.credit_for(refreshed) if refreshed else (None, {})
        if old_rows is not None:
            store.append_credits(rename_method(old_rows, self.rule.method_suffix,
                                               policy.policy_version),
                                 key=commit_key("reuse-credit"))
        if new_rows is not None:
            store.append_credits(new_rows, key=commit_key("refresh-credit"))
        new_seqs = [build_sequences(t, policy.prompt_ids) for t in refreshed]
        prox = dict(prox)
        prox.update(score_actions(model, new_seqs, layout, micro_tokens, policy.pad_id,
                                  row_tokens))
        credit = {**old_credit, **new_credit}
        staleness = {t.tree_id: s for t, s in zip(sel.trees, sel.staleness, strict=True)}
        staleness.update({t.tree_id: 0 for t in refreshed})
        n_pairs = sum(step.pairs.get(k, 0) for k in DECISIONS)
        metrics.update({
            "reuse_trees": float(len(sel.trees)), "reuse_refreshed_trees": float(len(refreshed)),
            "reuse_credit_read_trees": float(read),
            **{f"reuse_pairs_{k}": float(step.pairs.get(k, 0)) for k in DECISIONS},
            "reuse_pairs_feasible": float(step.feasible_pairs),
            "reuse_feasible_frac": step.feasible_pairs / n_pairs if n_pairs else 0.0,
            "reuse_new_tool_steps": float(step.new_tool_steps),
            "reuse_calibration_tool_steps": float(step.calibration_tool_steps),
            "reuse_refresh_all_tool_steps": float(sum(tool_steps(t) for t in sel.trees)),
            "reuse_staleness_mean": float(np.mean(sel.staleness)) if sel.staleness else 0.0,
            "reuse_staleness_max": float(max(sel.staleness, default=0)),
            **{f"reuse_skip_{k}": float(sel.skipped.get(k, 0)) for k in SKIP_REASONS}})
        self._w = dict.fromkeys(self._w, 0.0)
        return StoredBatch(list(sel.trees) + refreshed, old_seqs + new_seqs, credit, prox,
                           staleness, metrics)

    def weight(self, mb: MicroBatch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss step's (K,) behaviour weight and (K,) log pi_prox (the PPO ratio's
        denominator) of ``mb``; 1 and ``mb.old_logp`` on fresh tokens (``mb.stored``
        False). G8 caps w = pi_prox / mu by ``is_cap`` (``is_mode``); M1 (``m2po``)
        instead zeroes the weight of the stored tokens ``m2po_mask`` drops, w otherwise
        uncapped; P1 (``prox-interp``) takes log pi_prox from ``interp_prox``."""
        k = mb.n_loss_tokens
        stored = mb.stored if mb.stored is not None else torch.zeros(k, dtype=torch.bool)
        old = mb.old_logp
        if self.rule.prox == "interp":
            s = mb.staleness if mb.staleness is not None else torch.zeros(k)
            old = torch.where(stored, interp_prox(mb.behav_logp, logp, s), old)
        if self.rule.weight == "m2po":
            ratio = old - mb.behav_logp
            keep = torch.ones_like(stored)
            keep[stored] = m2po_mask(ratio[stored], self.params.m2po_threshold)
            w = torch.where(stored, torch.exp(ratio.clamp(-20.0, 20.0)), torch.ones_like(old))
            w = (w * keep).detach()
            over = ~keep
            self._w["masked"] += float(over.sum())
        else:
            w, over = behaviour_weight(old, mb.behav_logp, self.is_cap, self.is_mode)
            w = torch.where(stored, w, torch.ones_like(w))  # fresh: pi_old = mu, w = 1
        self._w["sum"] += float(w[stored].sum())
        self._w["over"] += float(over[stored].sum())
        self._w["tokens"] += float(stored.sum())
        return w, old

    def loss_metrics(self) -> dict[str, float]:
        """The behaviour-weight statistics of the iteration's loss steps."""
        n = self._w["tokens"]
        out = {"is_weight_mean": self._w["sum"] / n if n else 1.0,
               "is_over_cap_frac": self._w["over"] / n if n else 0.0}
        if self.rule.weight == "m2po":
            out["m2po_masked_frac"] = self._w["masked"] / n if n else 0.0
        return out


def make_reuse(config: Any, credit_for: CreditFor,
               credit_key: tuple[str, str] | None = None) -> ReuseStage | None:
    """The reuse stage of a ``TrainConfig`` (None for ``reuse none``), with every field of
    the run its ``step`` reads bound (``RunBinding``); ``credit_for`` / ``credit_key``: the
    run's credit stage (``train.credit_stage.CreditStage.credit`` / ``.stored_key``)."""
    if config.reuse == "none":
        return None
    run = RunBinding(env=partial(make_env, config.env), env_name=config.env,
                     run_id=config.resolved_run_id, seed=config.seed, out=Path(config.out),
                     layout=config.layout, micro_tokens=config.micro_tokens,
                     row_tokens=config.tree_row_tokens or None,
                     max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                     credit_for=credit_for, credit_key=credit_key)
    return ReuseStage(get_rule(config.reuse), ReuseParams.parse(config.reuse_params),
                      config.reuse_from, config.reuse_per_step, config.max_staleness,
                      config.is_cap, config.is_mode, run)


__all__ = ["CreditFor", "ReuseStage", "RunBinding", "StoredBatch", "StoredStep", "interp_prox",
           "m2po_mask", "make_reuse", "rename_method", "resolve_stored"]
