"""Gate study (DSC-Gate Table 2 / METHODS.md section 5, L4) on ``workflow`` tasks: the data.

Which credit does a gate trust after a policy update mu -> pi, and what does it
cost? The three-action setting of section 5: in a fixed context (the task's
initial state) the candidate root actions are the three valid tools (``fast``,
``careful``, ``skip``); a gate must pick the best one under pi. On ``workflow``
the regret of a pick is exact: max_a Q_pi(s0, a) - Q_pi(s0, pick).

Pipeline (``run_gate_study``; the report, steps 7 and after, is
``analysis.gates.gate_results``, which reads only the files written here). The
gates themselves run here, not in ``analysis``: a refreshing gate samples new
trajectories where its own estimates leave pairs unresolved, so deciding and
sampling are one experiment; its decisions reach the report as data.

1. **Old data (collection).** Per task an old policy mu and N old interventional
   trajectories per root action, sampled from mu through ``WorkflowEnv.step``
   (root action forced), archived as interventional trees in a store under
   ``out_dir/store`` (layout: ``train.studies.workflow_study``); mu's logits ride in
   each tree's meta, the context's env snapshot in the snapshots table.
2. **Updates.** Per task, ordinary and branch-selective updates at matched
   global-KL targets (``workflow_study.make_updates``).
3. **Estimates (from the store).** The trees are read back into one
   ``TreeArrays`` batch; ratios pi/mu and state ids go into the ``dsc`` extras, and
   per root action we form the reuse mean, the transported mean (D3-D5, the real
   ``train.credit.dsc.transport_returns``), a WIS and a DR estimate.
4. **Calibration (D7).** Residual variances of c_R, delta, c_T come from the dev
   tasks, the radii multipliers kappa from the calibration tasks
   (``calibrate_kappa``: the ceil((n+1)*0.95)-th per-task maximum standardized error,
   maximum over pairs and updates), against the exact c_mu, Delta c and c_pi.
5. **Gates on the evaluation tasks**, per (task, update) instance:

   * ``dsc``: ``dsc_gate`` (D8-D10) per leader-vs-competitor pair; reuse keeps the old
     order, transport uses the sign of c_T, refresh pairs go to the refresh protocol
     with transported priors;
   * ``gap`` / ``wis`` / ``dr``: every pair goes to the refresh protocol with the
     reuse / WIS / DR prior (METHODS: "gap-based refresh from the reuse prior",
     "self-normalized importance sampling ... and adaptive allocation",
     "a sequential doubly robust prior with the same refresh");
   * ``reuse_only`` / ``transport_only``: argmax of the reuse / transported means, no
     new samples; ``oracle``: argmax of the exact Q_pi (a check: regret 0).

6. **Refresh protocol** (section 5; ``train.sampling.refresh``): a Beta posterior per
   route with prior
   pseudo-count n0 = min(N, 0.25 / max(v, 1e-12)), prior successes n0 * clip(m, 0, 1),
   plus Beta(0.5, 0.5); new trajectories from pi go only to routes in unresolved
   pairs, in proportion to v / max(gap, 0.02)^2; the current leader is compared with
   each competitor and a pair is resolved when |m_a - m_b| > kappa_e sqrt(v_a + v_b);
   a trajectory cut by the cap consumes budget but does not update the posterior;
   cap 1,536 new tool steps. New trajectories are sampled from pi through the env from
   the stored context snapshot; every env step is a tool step. All gates of an instance
   share the k-th trajectory of each route (common random numbers); the union is
   archived as a ``refresh`` tree.
7. **Data files**: per-instance rows (pick, exact regret, new steps, DSC's decisions)
   go to ``instances.parquet``, per-route estimates to ``routes.parquet``, the D7
   calibration and the run's settings to ``study.json``. The metrics (mean regret,
   P(regret > 0.02), mean new tool steps, any-refresh rate, the task-cluster
   bootstrap CI of DSC - Gap) are ``analysis.gates``'s, computed from those files.

Choices [R] (METHODS leaves them open):

* WIS prior: m = sum_i W_i R_i / sum_i W_i with W_i the product of pi/mu over the
  downstream steps (forced root action excluded), v = sum_i W_i^2 (R_i - m)^2 /
  (sum_i W_i)^2 (delta method), floored at 1/(4N^2).
* DR prior: per trajectory the backward recursion D_{K+1} = R, D_t = v_pi(S_t) +
  rho_t (D_{t+1} - q(S_t, A_t)) (Jiang & Li 2016), with q(s, u) the mean old return
  after taking u in observable state s and v_pi(s) = sum_u pi(u|s) q(s, u), both
  cross-fitted on the opposite odd/even fold (the folds of ``train.credit.dsc``);
  fallbacks: the state's mean return, then the fold's mean return. m = mean, v =
  sample variance / N (floored).
* DSC refresh prior: the transported mean and its variance; refresh-resolved
  competitors beat the leader when their posterior mean is higher; when several
  competitors beat the leader, the one with the highest estimate wins.
* kappa_e = 2; allocation rounds of 4 trajectories by largest remainder; the leader's
  allocation weight uses its smallest gap to an unresolved competitor.
* Residual variance of X from the dev set: max(0, mean(err_X^2 - s_X^2)).
* "Reproduces the paper's finding" means: the one-sided 95% upper bound of the
  paired regret difference DSC - Gap is <= ``margin`` (0.005 by default: our runs
  are about 100x smaller than L4's 360 tasks with the paper's margin 0.0005) AND DSC's
  mean new tool steps are <= ``step_ratio_max`` (0.8) times Gap's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_store import Store, Tree, connect
from train.coerce import check_bounds, check_types
from train.credit.dsc import RATIO, STATE, transport_returns
from train.credit.dsc_gate import DSCGateParams, GatePairs, calibrate_radii, dsc_gate
from train.envs.base import Task
from train.envs.workflow import DEFAULT_HORIZONS, WorkflowEnv, action_text
from train.envs.workflow_policy import TabularPolicy
from train.policies import load_policy
from train.policies.base import Policy
from train.policies.errors import PolicyUnavailableError
from train.sampling.references import ReferenceConfig, run_references
from train.sampling.refresh import RefreshSampler, refresh_protocol
from train.studies import STUDY_MAXIMA
from train.studies.estimates import RouteEstimates, old_trajectories, route_estimates
from train.studies.lm_tables import TREES_PER_PASS, lm_tables, outcome_starts
from train.studies.sensitivity import UpdateAnalysis
from train.studies.workflow_study import (
    DEFAULT_KL_TARGETS,
    UPDATE_KINDS,
    Log,
    Rollout,
    RouteData,
    Update,
    UpdateKind,
    base_policy,
    config_hash,
    context_snapshots,
    load_route_data,
    log_progress,
    make_study_dir,
    make_tasks,
    make_updates,
    policy_from_json,
    policy_to_json,
    route_tree,
    sample_from,
    stream_key,
    task_model,
    tool_name,
    write_study,
)

GateName = Literal["dsc", "gap", "wis", "dr", "reuse_only", "transport_only", "oracle"]
GATES: tuple[GateName, ...] = ("dsc", "gap", "wis", "dr", "reuse_only", "transport_only",
                               "oracle")
Split = Literal["dev", "calib", "eval"]

# The settings that define the archived trajectories (the rest only change the analysis).
DATA_FIELDS = ("n_dev", "n_calib", "n_eval", "n_old", "seed", "horizons", "kinds", "kl_targets",
               "kappa_e", "cap_steps", "refresh_batch", "min_gap", "level", "mu_beta",
               "mu_noise", "noise_frac", "archive_refresh", "competing_share",
               "competing_gap", "lm_mu", "lm_pi")


@dataclass(frozen=True)
class GateStudyConfig:
    """The gate evaluation's settings (defaults: under a minute on one core). A bigger run:
    e.g. ``GateStudyConfig(n_dev=96, n_calib=96, n_eval=288)`` (L2-L3's split sizes)."""

    n_dev: int = 20
    """Tasks for the residual variances of D7."""
    n_calib: int = 20
    """Tasks for the kappa order statistic of D7 (>= 19 for level 0.95)."""
    n_eval: int = 40
    """Evaluation tasks; each gives len(kinds) * len(kl_targets) instances."""
    n_old: int = 64
    """Old trajectories per root action (METHODS L2-L3: 16 / 64 / 256)."""
    seed: int = 0
    """Seeds tasks, mu, updates and every trajectory."""
    horizons: tuple[int, ...] = DEFAULT_HORIZONS
    kinds: tuple[UpdateKind, ...] = UPDATE_KINDS
    """Update kinds (L4: ordinary + branch-selective)."""
    kl_targets: tuple[float, ...] = DEFAULT_KL_TARGETS
    """Matched global-KL sizes of the updates (0 gives pi = mu)."""
    level: float = 0.95
    """D7 conformal level of kappa."""
    kappa_e: float = 2.0
    """Refresh resolution multiplier [R]."""
    cap_steps: int = 1536
    """Refresh cap in new tool steps per instance (section 5)."""
    refresh_batch: int = 4
    """Trajectories allocated per refresh round [R]."""
    min_gap: float = 0.02
    """The allocation's gap floor: v / max(gap, 0.02)^2 (section 5)."""
    regret_threshold: float = 0.02
    """P(regret > 0.02) (section 5 metrics)."""
    margin: float = 0.005
    """Non-inferiority margin for the DSC - Gap regret difference [R]."""
    step_ratio_max: float = 0.8
    """'Markedly fewer steps': DSC / Gap mean new steps at most this [R]."""
    n_boot: int = 2000
    """Task-cluster bootstrap resamples (the paper: 10k paired)."""
    mu_beta: float = 3.0
    mu_noise: float = 0.5
    noise_frac: float = 0.5
    archive_refresh: bool = True
    """Archive each instance's refresh trajectories as a tree in the store."""
    competing_share: float | None = None
    """L4's test mix [R]: the share of *competing* evaluation tasks (0.75 = the paper's
    270 competing + 90 serial); None: evaluation tasks as generated. A task is competing
    when its two best root actions under mu differ by less than ``competing_gap`` in exact
    Q_mu (the decision is contested), else *serial* (one route leads; what remains is a
    chain of stages). The class uses mu only (no update, no test outcome)."""
    competing_gap: float = 0.1
    """Q_mu gap below which a task's root decision is competing [R]."""
    lm_mu: str = ""
    """The real-update variant (docs/METHODS.md 8.3, LM1-LM3): a policy spec (``tiny``,
    ``hf:DIR``, a checkpoint directory) whose language model, read as an observable-state policy
    (``train.studies.lm_tables``, LM1), is mu on every task; '' (default): the synthetic
    mu of ``mu_beta`` / ``mu_noise``."""
    lm_pi: tuple[str, ...] = ()
    """With ``lm_mu``: the updated models (e.g. trainer checkpoints one and four iterations
    later), read the same way; each is one update, labelled ``pi1``, ``pi2``, ... in place
    of ``kinds`` x ``kl_targets``."""
    lm_check_tasks: int = 20
    """With ``lm_mu``: evaluation tasks on which each model's exact root Q (LM1) is checked
    against Monte Carlo of the real model (LM3); 0: no check."""
    lm_check_k: int = 1000
    """Rollouts of the real model per (root tool, outcome) child in that check."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_boot": 1}, STUDY_MAXIMA)
        if self.competing_share is not None and not 0.0 <= self.competing_share <= 1.0:
            raise ValueError(f"competing_share must be in [0, 1], got {self.competing_share}")
        for name in ("n_calib", "n_eval", "n_old", "cap_steps", "refresh_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_dev < 0:
            raise ValueError(f"n_dev must be >= 0, got {self.n_dev}")
        if not self.kl_targets or min(self.kl_targets) < 0:
            raise ValueError(f"kl_targets must be non-empty and >= 0, got {self.kl_targets}")
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must be in (0, 1), got {self.level}")
        if bool(self.lm_mu) != bool(self.lm_pi):
            raise ValueError("lm_mu and lm_pi go together: the real-update variant needs the "
                             "old model and at least one updated one")
        if self.lm_check_tasks < 0 or self.lm_check_k < 1:
            raise ValueError("lm_check_tasks must be >= 0 and lm_check_k >= 1")

    @property
    def run_id(self) -> str:
        """``gates-{seed}-{hash of the data-defining settings}``."""
        return f"gates-{self.seed}-{config_hash(self, DATA_FIELDS)}"


def refresh_sampler(env: WorkflowEnv, snapshot: bytes, policy: TabularPolicy,
                    actions: Sequence[str], key: tuple[object, ...]
                    ) -> RefreshSampler[Rollout]:
    """New trajectories of one instance from pi, restored from the context snapshot: the
    k-th trajectory of a route is fixed by (seed, instance, route, k) and cached, so every
    gate of the instance sees the same k-th trajectory (common random numbers)."""

    def draw(route: int, k: int) -> Rollout:
        return sample_from(env, snapshot, policy, stream_key(*key, route, k), actions[route])

    return RefreshSampler(draw)


# ----------------------------------------------------------------- gates
@dataclass
class GateOutcome:
    pick: int
    steps: int = 0
    decisions: dict[str, int] = field(default_factory=dict)


def _argmax(values: np.ndarray) -> int:
    return int(np.argmax(values))  # ties: the first route in preorder


def run_gate(gate: GateName, est: RouteEstimates, sampler: Callable[[int, int], Rollout],
             config: GateStudyConfig, dsc_pairs: Sequence[tuple[int, int, str, float]] = ()
             ) -> GateOutcome:
    """One gate's pick on one instance. ``dsc_pairs``: (leader, competitor, decision, c_T)
    route indices of the instance's D8-D10 decisions (for ``dsc``)."""
    refresh_kw: dict[str, Any] = {"kappa_e": config.kappa_e, "cap_steps": config.cap_steps,
                                  "batch": config.refresh_batch, "min_gap": config.min_gap}
    if gate == "oracle":
        return GateOutcome(_argmax(est.q_pi))
    if gate == "reuse_only":
        return GateOutcome(_argmax(est.mean["reuse"]))
    if gate == "transport_only":
        return GateOutcome(_argmax(est.mean["transport"]))
    if gate in ("gap", "wis", "dr"):
        prior = {"gap": "reuse", "wis": "wis", "dr": "dr"}[gate]
        res = refresh_protocol(est.mean[prior], est.var[prior], est.n,
                               range(len(est.actions)), sampler, **refresh_kw)
        return GateOutcome(res.leader, res.steps)
    if gate != "dsc":
        raise ValueError(f"unknown gate {gate!r}; one of {GATES}")
    decisions = {"reuse": 0, "transport": 0, "refresh": 0}
    if not dsc_pairs:
        return GateOutcome(_argmax(est.mean["reuse"]), 0, decisions)
    leader = dsc_pairs[0][0]
    for _, _, decision, _ in dsc_pairs:
        decisions[decision] += 1
    to_refresh = [c for _, c, d, _ in dsc_pairs if d == "refresh"]
    posterior: np.ndarray | None = None
    steps = 0
    if to_refresh:
        res = refresh_protocol(est.mean["transport"], est.var["transport"], est.n,
                               [leader, *to_refresh], sampler, **refresh_kw)
        posterior, steps = res.mean, res.steps
    beaters: list[tuple[float, int]] = []
    for _, comp, decision, c_t in dsc_pairs:
        if decision == "transport" and c_t < 0:
            beaters.append((float(est.mean["transport"][comp]), comp))
        elif decision == "refresh" and posterior is not None \
                and posterior[comp] > posterior[leader]:
            beaters.append((float(posterior[comp]), comp))
    pick = max(beaters, key=lambda x: (x[0], -x[1]))[1] if beaters else leader
    return GateOutcome(pick, steps, decisions)


# ----------------------------------------------------------------- the study
def _collect_old(store: Store, config: GateStudyConfig, lms: dict[str, Policy],
                 log: Log | None = None) -> None:
    """Sample and archive the old interventional trees (idempotent per run id: a store
    that already holds them is left as it is)."""
    stored = connect(store).execute("SELECT count(*) FROM trees WHERE run_id = ? "
                                    "AND sampler = 'interventional'",
                                    [config.run_id]).fetchall()[0][0]
    if stored:
        return
    env = WorkflowEnv()
    trees: list[Tree] = []
    tasks = _study_tasks(config, lms, log)
    start = time.perf_counter()
    for i, task, split, mu, task_class in tasks:
        log_progress(log, "old trees", len(trees), len(tasks), start)
        model = task_model(task)
        prompt = env.reset(task)
        snapshot = env.snapshot()
        routes = {a: [sample_from(env, snapshot, mu, stream_key(config.seed, "old",
                                                                task.task_id, a, k), a)
                      for k in range(config.n_old)]
                  for a in model.valid_actions(model.initial_state())}
        trees.append(route_tree(
            task, f"{config.run_id}/old/{task.task_id}", config.run_id, (prompt, snapshot),
            routes, "old", policy_version="mu", seed=config.seed,
            meta={"study": "gates", "split": split, "task_index": i,
                  "task_class": task_class, "mu": policy_to_json(mu)}))
    store.append_trees(trees, key=f"{config.run_id}:old")


def task_class(model: Any, mu: TabularPolicy, gap: float) -> str:
    """``competing`` when the two best root actions' exact Q_mu differ by < ``gap``, else
    ``serial`` (``GateStudyConfig.competing_share``)."""
    q = sorted(mu.values().q_values(model.initial_state()).values(), reverse=True)
    return "competing" if len(q) > 1 and q[0] - q[1] < gap else "serial"


def load_lms(config: GateStudyConfig) -> dict[str, Policy]:
    """The ``workflow`` language models of the real-update variant by spec (``lm_mu`` and
    ``lm_pi``; none for the synthetic updates), each loaded once for the whole study;
    ``ValueError`` naming the spec that cannot be loaded."""
    out: dict[str, Policy] = {}
    for spec in (config.lm_mu, *config.lm_pi) if config.lm_mu else ():
        if spec not in out:
            try:
                out[spec] = load_policy(spec, "workflow")
            except (OSError, ValueError, PolicyUnavailableError) as exc:
                raise ValueError(f"lm policy {spec!r}: {exc}") from None
    return out


def _study_tasks(config: GateStudyConfig, lms: dict[str, Policy], log: Log | None = None
                 ) -> list[tuple[int, Task, Split, TabularPolicy, str]]:
    """(task index, task, split, mu, class) of every study task. Dev and calib tasks come
    first, as generated; evaluation tasks follow, as generated, or (``competing_share``)
    drawn in generation order until round(share * n_eval) competing and the rest serial
    tasks are found (at most 50x n_eval candidates, then whatever was found). mu is the
    synthetic policy, or with ``lm_mu`` the language model read per task (LM1)."""
    n_fixed = config.n_dev + config.n_calib
    lm = lms[config.lm_mu] if config.lm_mu else None
    start = time.perf_counter()

    def make(pairs: Sequence[tuple[int, Task]]) -> list[tuple[TabularPolicy, str]]:
        models = [task_model(task) for _, task in pairs]
        if lm is not None:
            mus = [t.policy for t in lm_tables(lm, [task for _, task in pairs], models)]
        else:
            mus = [base_policy(model, np.random.default_rng([config.seed, i, 2]),
                               config.mu_beta, config.mu_noise)
                   for (i, _), model in zip(pairs, models, strict=True)]
        return [(mu, task_class(model, mu, config.competing_gap))
                for mu, model in zip(mus, models, strict=True)]

    out: list[tuple[int, Task, Split, TabularPolicy, str]] = []
    if config.competing_share is None:
        tasks = list(enumerate(make_tasks(n_fixed + config.n_eval, config.seed,
                                          config.horizons)))
        for (i, task), made in zip(tasks, make(tasks), strict=True):
            split: Split = "dev" if i < config.n_dev else "calib" if i < n_fixed else "eval"
            out.append((i, task, split, *made))
        return out
    n_max = n_fixed + 50 * config.n_eval
    tasks = list(enumerate(make_tasks(n_max, config.seed, config.horizons)))
    quota = {"competing": round(config.competing_share * config.n_eval)}
    quota["serial"] = config.n_eval - quota["competing"]
    chunk = TREES_PER_PASS if lm is not None else 1
    total, decile = n_fixed + config.n_eval, -1
    for first in range(0, n_max, chunk):
        if first >= n_fixed and not any(quota.values()):
            break
        if lm is not None and log is not None and 10 * len(out) // total > decile:
            decile = 10 * len(out) // total
            log(f"tasks (mu read from the language model): {len(out)}/{total} "
                f"({time.perf_counter() - start:.0f} s)")
        for (i, task), (mu, cls) in zip(tasks[first:first + chunk],
                                        make(tasks[first:first + chunk]), strict=True):
            if i < n_fixed:
                out.append((i, task, "dev" if i < config.n_dev else "calib", mu, cls))
            elif quota[cls] > 0:
                quota[cls] -= 1
                out.append((i, task, "eval", mu, cls))
    return out


def _task_of(data: RouteData, t: int) -> Task:
    model = data.models[t]
    return Task(task_id=data.tasks[t], env="workflow", prompt=model.prompt(),
                max_steps=model.horizon, config=model.spec.to_config())


def _pair_routes(data: RouteData, pairs: GatePairs) -> tuple[np.ndarray, np.ndarray]:
    """(P,) route indices (within its tree) of each pair's leader and competitor."""
    return data.route_index[pairs.leader], data.route_index[pairs.competitor]


def root_q(data: RouteData, policies: Sequence[TabularPolicy]) -> list[np.ndarray]:
    """Exact Q(s0, a) of every route of every tree (A,) under that tree's policy."""
    out = []
    for t, policy in enumerate(policies):
        values = policy.values()
        s0 = data.models[t].initial_state()
        out.append(np.array([values.q(s0, a) for a in data.route_actions[t]]))
    return out


def _pair_truth(data: RouteData, pairs: GatePairs, q_mu: Sequence[np.ndarray],
                q_pi: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Exact c_mu and c_pi (P,) of every gate pair (route values scattered to their rows)."""
    out = []
    for q in (q_mu, q_pi):
        at_row = np.zeros(data.batch.n_nodes)
        for rows, values in zip(data.routes, q, strict=True):
            at_row[rows] = values
        out.append(at_row[pairs.leader] - at_row[pairs.competitor])
    return out[0], out[1]


def lm_updates(data: RouteData, mu: Sequence[TabularPolicy], specs: Sequence[str],
               lms: dict[str, Policy], log: Log | None = None) -> list[list[Update]]:
    """Per tree, one update per language model of ``specs`` (labels ``pi1``, ``pi2``, ...):
    the model read on the tree's task (LM1), its exact global KL from mu."""
    tasks = [_task_of(data, t) for t in range(data.batch.n_trees)]
    out: list[list[Update]] = [[] for _ in tasks]
    start = time.perf_counter()
    for j, spec in enumerate(specs):
        log_progress(log, f"updates read from {len(specs)} language models", j, len(specs),
                     start)
        for t, table in enumerate(lm_tables(lms[spec], tasks, data.models)):
            kl = UpdateAnalysis(data.models[t], mu[t], table.policy).global_kl()
            out[t].append(Update(f"pi{j + 1}", math.nan, 0.0, kl, table.policy))
    return out


def lm_check(config: GateStudyConfig, data: RouteData, mu: Sequence[TabularPolicy],
             updates: Sequence[Sequence[Update]], trees: Sequence[int],
             lms: dict[str, Policy], log: Log | None = None) -> pa.Table:
    """LM3 on the evaluation trees ``trees``: per model (mu, pi1, ...), task and root tool,
    the exact Q of the model's reading (LM1) beside the Monte Carlo Q of the real model
    (``lm_check_k`` rollouts per (tool, outcome) start, ``run_references``: the engine,
    full transcripts) and its standard error."""
    starts = [outcome_starts(_task_of(data, t)) for t in trees]
    flat = [o.start for task_starts in starts for o in task_starts]
    models = [("mu", config.lm_mu, list(mu))] + [
        (f"pi{j + 1}", spec, [updates[t][j].policy for t in range(len(updates))])
        for j, spec in enumerate(config.lm_pi)]
    k = config.lm_check_k
    rows: dict[str, list[Any]] = {}
    start = time.perf_counter()
    for done, (label, spec, tables) in enumerate(models):
        log_progress(log, f"lm check: {len(flat)} starts x {k} rollouts per model", done,
                     len(models), start)
        wins = iter(run_references(lms[spec], WorkflowEnv, flat,
                                   ReferenceConfig(k=k, seed=config.seed)))
        for t, task_starts in zip(trees, starts, strict=True):
            values = tables[t].values()
            s0 = data.models[t].initial_state()
            by_tool: dict[str, list[tuple[float, float]]] = {}
            for o in task_starts:
                by_tool.setdefault(o.tool, []).append((o.p, next(wins) / k))
            for tool, parts in by_tool.items():
                q_mc = sum(p * q for p, q in parts)
                se = math.sqrt(sum(p * p * q * (1 - q) for p, q in parts) / k)
                for key, value in (("model", label), ("spec", spec),
                                   ("task_id", data.tasks[t]), ("route", tool),
                                   ("q_exact", values.q(s0, action_text(tool))),
                                   ("q_mc", q_mc), ("se", se), ("k", k)):
                    rows.setdefault(key, []).append(value)
    return pa.table(rows)


def calibrate(per_update: Sequence[tuple[GatePairs, np.ndarray, np.ndarray]],
              split_of_tree: Sequence[Split], level: float) -> dict[str, Any]:
    """D7: residual variances on dev trees, kappas on calib trees
    (``train.credit.dsc_gate.calibrate_radii``, the one calibration the trainer's reuse
    uses too). ``per_update``: (pairs computed with zero residuals, exact c_mu, exact c_pi)
    per update."""
    return calibrate_radii(per_update, split_of_tree, level)


def run_gate_study(out_dir: str | Path, config: GateStudyConfig | None = None,
                   kind: str = "gates", log: Log | None = None) -> Path:
    """Run the gate study; write ``store/``, ``instances.parquet``, ``routes.parquet``,
    ``pairs.parquet`` (DSC's leader-vs-competitor pairs on the evaluation tasks: gaps,
    scales, radii, decision, exact c_mu and c_pi) and ``study.json`` (study ``kind``:
    ``gates``, or ``dsc-table2`` for ``rtrees study dsc-table2``) to ``out_dir`` (the
    report: ``analysis.gates.gate_results``); return the path of ``study.json``. Progress
    lines go to ``log``."""
    config = config or GateStudyConfig()
    lms = load_lms(config)  # a bad spec fails before the store or any study file exists
    out = make_study_dir(out_dir)
    start = time.perf_counter()
    store_path = out / "store"
    store = Store(store_path, create=not store_path.exists())
    _collect_old(store, config, lms, log)
    t_collect = time.perf_counter() - start

    data = load_route_data(store, config.run_id)
    snapshots = context_snapshots(store, config.run_id)
    n_trees = data.batch.n_trees
    split_of_tree: list[Split] = [data.meta[t]["split"] for t in range(n_trees)]
    mu = [policy_from_json(data.models[t], data.meta[t]["mu"]) for t in range(n_trees)]
    if config.lm_mu:
        updates = lm_updates(data, mu, config.lm_pi, lms, log)
    else:
        updates = [make_updates(
            data.models[t], mu[t],
            np.random.default_rng([config.seed, int(data.meta[t]["task_index"]), 3]),
            config.kinds, config.kl_targets, config.noise_frac) for t in range(n_trees)]
    n_updates = len(updates[0])
    trajs = old_trajectories(data)
    states = data.state_ids()

    # Estimates and zero-residual gate pairs per update (every tree).
    base = DSCGateParams(kappa_R=1.0, kappa_delta=1.0, kappa_T=1.0)
    q_mu = root_q(data, mu)
    per_update = []
    for u in range(n_updates):
        log_progress(log, "updates, gate pairs", u, n_updates, start)
        pi = [updates[t][u].policy for t in range(n_trees)]
        q_pi = root_q(data, pi)
        ratio = data.ratios(pi, mu)
        batch = replace(data.batch, extras={RATIO: ratio, STATE: states})
        pairs = dsc_gate(batch, base)
        c_mu, c_pi = _pair_truth(data, pairs, q_mu, q_pi)
        per_update.append((pairs, c_mu, c_pi, batch, ratio, pi, q_pi))
    calib = calibrate([(p, cm, cp) for p, cm, cp, *_ in per_update], split_of_tree,
                      config.level)
    params = DSCGateParams(
        kappa_R=calib["R"]["kappa"], kappa_delta=calib["delta"]["kappa"],
        kappa_T=calib["T"]["kappa"], residual_var_R=calib["R"]["residual_var"],
        residual_var_delta=calib["delta"]["residual_var"],
        residual_var_T=calib["T"]["residual_var"])

    eval_trees = [t for t in range(n_trees) if split_of_tree[t] == "eval"]
    env = WorkflowEnv()
    inst_rows: dict[str, list[Any]] = {}
    route_rows: dict[str, list[Any]] = {}
    pair_rows: dict[str, list[Any]] = {}
    refresh_trees = []
    for u, (_, _, _, batch, ratio, pi, q_pi) in enumerate(per_update):
        log_progress(log, "updates, gates and refresh", u, n_updates, start)
        tr = transport_returns(batch)
        pairs = dsc_gate(batch, params)
        by_tree: dict[int, list[tuple[int, int, str, float]]] = {}
        leads, comps = _pair_routes(data, pairs)
        for t, lead, comp, decision, c_t in zip(pairs.tree.tolist(), leads.tolist(),
                                                comps.tolist(), pairs.decision.tolist(),
                                                pairs.c_T.tolist(), strict=True):
            by_tree.setdefault(t, []).append((lead, comp, str(decision), float(c_t)))
        c_mu_all, c_pi_all = _pair_truth(data, pairs, q_mu, q_pi)
        is_eval = np.isin(pairs.tree, eval_trees)
        for j in np.flatnonzero(is_eval).tolist():
            t = int(pairs.tree[j])
            row = {"task_id": data.tasks[t], "update": u, "kind": updates[t][u].kind,
                   "kl_target": updates[t][u].kl_target,
                   "task_class": data.meta[t].get("task_class", "n/a"),
                   "leader": tool_name(data.route_actions[t][int(leads[j])]),
                   "competitor": tool_name(data.route_actions[t][int(comps[j])]),
                   "decision": str(pairs.decision[j]), "c_mu": float(c_mu_all[j]),
                   "c_pi": float(c_pi_all[j]),
                   **{name: float(getattr(pairs, name)[j]) for name in (
                       "c_R", "c_T", "delta", "s_R", "s_delta", "s_T", "r_R", "r_delta",
                       "r_T")}}
            for key, value in row.items():
                pair_rows.setdefault(key, []).append(value)
        estimates = route_estimates(data, trajs, tr, ratio, eval_trees, pi, q_mu, q_pi)
        for t in eval_trees:
            est = estimates[t]
            upd = updates[t][u]
            task_id = data.tasks[t]
            sampler = refresh_sampler(env, snapshots[data.batch.tree_ids[t]], pi[t],
                                      est.actions, (config.seed, "refresh", task_id, u))
            best = float(est.q_pi.max())
            top2_gap = best - float(np.sort(est.q_pi)[-2]) if len(est.q_pi) > 1 else math.inf
            for gate in GATES:
                res = run_gate(gate, est, sampler, config, by_tree.get(t, []))
                for key, value in (
                        ("task_id", task_id), ("update", u), ("kind", upd.kind),
                        ("kl_target", upd.kl_target), ("kl", upd.kl), ("gate", gate),
                        ("pick", tool_name(est.actions[res.pick])),
                        ("regret", best - float(est.q_pi[res.pick])),
                        ("steps", res.steps), ("refreshed", res.steps > 0),
                        ("n_reuse", res.decisions.get("reuse", 0)),
                        ("n_transport", res.decisions.get("transport", 0)),
                        ("n_refresh", res.decisions.get("refresh", 0)),
                        ("top2_gap", top2_gap),
                        ("task_class", data.meta[t].get("task_class", "n/a"))):
                    inst_rows.setdefault(key, []).append(value)
            for r, action in enumerate(est.actions):
                row = {"task_id": task_id, "update": u, "kind": upd.kind,
                       "kl_target": upd.kl_target, "route": tool_name(action),
                       "n_old": est.n[r], "q_mu": est.q_mu[r], "q_pi": est.q_pi[r],
                       **{f"{k}_mean": est.mean[k][r] for k in est.mean},
                       **{f"{k}_var": est.var[k][r] for k in est.var}}
                for key, value in row.items():
                    route_rows.setdefault(key, []).append(value)
            if config.archive_refresh and sampler.cache:
                task = _task_of(data, t)
                refresh_trees.append(route_tree(
                    task, f"{config.run_id}/refresh/{task_id}/u{u}", config.run_id,
                    (task.prompt, snapshots[data.batch.tree_ids[t]]),
                    sampler.by_route(est.actions), "refresh", sampler="refresh",
                    policy_version=f"pi-{u}", seed=config.seed,
                    meta={"study": "gates", "update": u, "kind": upd.kind,
                          "kl_target": upd.kl_target, "eta": upd.eta, "kl": upd.kl,
                          "pi": policy_to_json(pi[t])}))
    if refresh_trees:
        store.append_trees(refresh_trees, key=f"{config.run_id}:refresh")
    labels = list(dict.fromkeys(u.kind for u in updates[0]))  # in update order
    check_path = None
    if config.lm_mu and config.lm_check_tasks:
        check = lm_check(config, data, mu, updates, eval_trees[:config.lm_check_tasks], lms,
                         log)
        check_path = out / "lm_check.parquet"
        pq.write_table(check, check_path)
    inst_path, routes_path = out / "instances.parquet", out / "routes.parquet"
    pairs_path = out / "pairs.parquet"
    pq.write_table(pa.table(inst_rows), inst_path)
    pq.write_table(pa.table(route_rows), routes_path)
    pq.write_table(pa.table(pair_rows), pairs_path)
    return write_study(out / "study.json", {
        "study": kind, "config": asdict(config), "run_id": config.run_id,
        "gates": list(GATES), "store": store_path.name, "instances_path": inst_path.name,
        "routes_path": routes_path.name, "pairs_path": pairs_path.name,
        "calibration": calib,
        "lm_check_path": check_path.name if check_path is not None else None,
        "update_labels": labels,
        "mean_kl": {label: float(np.mean([u.kl for row in updates for u in row
                                          if u.kind == label])) for label in labels},
        "lm_versions": {spec: str(lm.policy_version) for spec, lm in lms.items()},
        "n_eval_tasks": len(eval_trees), "n_instances": len(eval_trees) * n_updates,
        "seconds": {"collect_old": t_collect, "total": time.perf_counter() - start}})


__all__ = [
    "GATES", "GateName", "GateOutcome", "GateStudyConfig", "RouteEstimates", "calibrate",
    "old_trajectories", "refresh_sampler", "root_q", "route_estimates", "run_gate",
    "run_gate_study",
]
