"""train: environments, policies, samplers, credit, the trainer and its jobs.

The public entry points, importable from here (``from train import compute_credits``);
each is resolved lazily from the module path in ``_WHERE``, so ``import train`` loads
nothing else and a module that moves needs only its line here changed. Logging trees
from your own trainer is ``rollout_store.TreeLogger`` (the store's package, below every
other); ``TreeLoggerCallback`` does it for TRL's ``GRPOTrainer`` (``pip install
'rollout-trees[trl]'``). Guide: docs/guides/log-from-your-trainer.md.

``train``, ``analysis`` and ``cli`` are installed as top-level packages (the repository
layout is fixed), so a project with its own top-level ``train`` package collides with
this one.
"""

from __future__ import annotations

from rollout_store.lazy import lazy_face

_WHERE = {
    "train.config": ("ConfigError", "TrainConfig", "load_config"),
    "train.trainer": ("TrainError", "TrainReport", "train"),
    "train.credit": ("ESTIMATORS", "Credit", "Params", "TreeArrays", "register"),
    "train.credit.store_io": ("CreditError", "CreditRunReport", "compute_credits",
                              "credit_trees"),
    "train.envs": ("Environment", "Task", "make_env", "register_env"),
    "train.policies": ("load_policy",),
    "train.sampling": ("SAMPLERS", "make_sampler"),
    "train.sampling.references": ("ReferenceConfig", "collect_references"),
    "train.jobs": ("JobError", "RankingJobConfig", "RankingJobResult", "ranking_job"),
    "train.integrations.trl": ("TreeLoggerCallback",),
}
__getattr__, __all__ = lazy_face("train", _WHERE)
