"""The credit audit on environments nobody here wrote (``rtrees study third-party-audit``,
issue 47 item 4): the data.

One environment per run (``env``: any spec, e.g. ``gym-blackjack`` or ``reasoning-gym``),
one policy (``policy``), the same BEL trees for every estimator:

1. ``n_tasks`` tasks of the env's own generator (seed ``seed``, options ``task_params``,
   e.g. reasoning-gym's ``datasets`` and ``dataset_config``) and one ``bel`` tree per
   task with ``n_total`` rollouts (``train.sampling.collect.collect``, run id
   ``third-party-<seed>``) into ``out/store``;
2. credit by every estimator of ``methods`` (``train.scoring.score_and_credit``, default
   params but for the scoring policy: trace's ``ref`` and factor's and sgcd's ``teacher``
   are the study's ``policy``, which scores the stored trees first, ``scorer_params``).
   An estimator that cannot run on these trees (``slca`` needs segment labels an env
   without them lacks) is recorded with its one-line reason under ``dropped`` and left
   out of the audit;
3. (``train.jobs.third_party_audit``) the Mean@k ranking audit (``ranking_job``,
   docs/METHODS.md E10-E11): Mean@``k`` references of every child of every branching
   node, then pairwise accuracy and Kendall tau-b of each estimator's child scores
   against them, with a tree bootstrap shared by every estimator (so paired differences
   get their own intervals), at the Bonferroni level of the study's claims
   (``analysis.verdicts.family_level`` of the estimators other than ``baseline``) into
   ``out/audit``.

``study.json`` records the settings, the estimators audited and dropped, the timings, and
whether the env declares exact values (``Environment.exact_values``). This study does not
compute the credit-exact cosine: that needs exact values under the sampling policy
(``rtrees study credit-exact`` on workflow's tabular policies), and no third-party adapter
declares them. The report, one verdict per estimator (its paired difference to
``baseline``), is ``analysis.third_party``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_store import Store
from train.coerce import check_bounds, check_types
from train.studies import STUDY_MAXIMA
from train.studies.workflow_study import Log, make_study_dir, write_study

KIND = "third-party-audit"
METHODS = ("grpo", "tree_grpo", "elpo", "caliper", "slca", "trace", "factor", "sgcd")
"""Every estimator the issue names; those that do not apply are dropped with a reason."""


@dataclass(frozen=True)
class ThirdPartyAuditConfig:
    """Settings of ``rtrees study third-party-audit``."""

    env: str = "gym-frozenlake"
    """Environment spec (a name, an entry point or ``module:Class``)."""
    policy: str = "tiny"
    """Policy spec that samples the trees and the references (``load_policy``)."""
    n_tasks: int = 32
    """Tasks, one BEL tree each (the bootstrap unit)."""
    n_total: int = 8
    """Rollouts per tree (ELPO's N_total)."""
    k: int = 32
    """Rollouts behind each Mean@k reference."""
    seed: int = 0
    """Seeds the tasks, the sampling, the references and the bootstrap."""
    task_params: dict[str, Any] = field(default_factory=dict)
    """Options of the env's ``generate_tasks`` (on the command line a JSON object:
    ``--param 'task_params={"datasets": ["products"]}'``); the policy should have been
    trained on the same mix (``rtrees policy init --task-param``)."""
    methods: tuple[str, ...] = METHODS
    baseline: str = "grpo"
    """Each other estimator's claim is its paired difference to this one."""
    delta: float = 0.05
    """Pre-registered equivalence margin (V1) of a difference in pairwise accuracy."""
    max_new_tokens: int = 64
    """Token cap of one agent step in the Mean@k references (the trees: the policy's own)."""
    n_boot: int = 2000
    """Tree bootstrap resamples."""

    def __post_init__(self) -> None:
        check_types(self)  # train.coerce: field types, finite floats (issue 21)
        check_bounds(self, {"n_boot": 1, "max_new_tokens": 1, "n_tasks": 1, "k": 1},
                     STUDY_MAXIMA)
        if self.n_total < 4:
            raise ValueError(f"n_total must be >= 4 for a tree to branch, got {self.n_total}")
        if self.baseline not in self.methods or len(self.methods) < 2:
            raise ValueError(f"methods must hold the baseline {self.baseline!r} and at least "
                             f"one other, got {list(self.methods)}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta}")


def scorer_params(method: str, policy: str) -> dict[str, str]:
    """The params that name the policy scoring ``method``'s inputs (trace's ``ref``, the
    token-scored methods' ``teacher``: ``train.credit.store_io``), set to the study's
    policy, so that every estimator reads scores of the policy that sampled the trees."""
    from train.credit.store_io import SCORED, TOKEN_SCORED

    if method in SCORED:
        return {SCORED[method][0]: policy}
    return {"teacher": policy} if method in TOKEN_SCORED else {}


def run_third_party_study(out_dir: str | Path, config: ThirdPartyAuditConfig | None = None,
                          log: Log | None = None) -> Path:
    """Steps 1-2 (trees and credit) into ``out_dir``; returns the path of ``study.json``.
    Step 3, the audit, is ``train.jobs``' (it runs the reference job and reads ``analysis``
    for the family level): ``train.jobs.third_party_audit`` runs all three."""
    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.scoring import score_and_credit

    config = config or ThirdPartyAuditConfig()
    out = make_study_dir(out_dir)
    say = log or (lambda line: None)
    start = time.perf_counter()
    cls = env_class(config.env)
    tasks = cls.generate_tasks(config.n_tasks, config.seed, **config.task_params)
    store = Store(out / "store", create=True)
    policy = load_policy(config.policy, config.env)
    report = collect(store, config.env, policy, "bel", tasks, n_total=config.n_total,
                     seed=config.seed, run_id=f"third-party-{config.seed}",
                     progress=log is not None)
    t_collect = time.perf_counter() - start
    say(f"collect: {report.trees} trees in {t_collect:.0f} s")
    audited: list[str] = []
    dropped: dict[str, str] = {}
    t_credit: dict[str, float] = {}
    for method in config.methods:
        t0 = time.perf_counter()
        try:
            score_and_credit(store, method, scorer_params(method, config.policy),
                             progress=False)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            if method == config.baseline:
                raise
            dropped[method] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            say(f"credit {method}: dropped ({dropped[method]})")
            continue
        audited.append(method)
        t_credit[method] = round(time.perf_counter() - t0, 2)
        say(f"credit {method}: {t_credit[method]:.0f} s")
    doc: dict[str, Any] = {
        "study": KIND, "config": asdict(config), "store": "store", "audit": "audit",
        "env_class": f"{cls.__module__}:{cls.__qualname__}",
        "exact_values": bool(cls.exact_values), "methods": audited, "dropped": dropped,
        "claims": len(audited) - 1, "trees": report.trees,
        "seconds": {"collect": round(t_collect, 1), "credit": t_credit}}
    return write_study(out / "study.json", doc)


__all__ = ["KIND", "METHODS", "ThirdPartyAuditConfig", "run_third_party_study",
           "scorer_params"]
