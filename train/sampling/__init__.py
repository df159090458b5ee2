"""Samplers: one task and a rollout budget ``n_total`` in, one rollout ``Tree`` out (issue 6).

``make_sampler(name, **params)`` builds one by name (``SAMPLERS``); each
sampler's budget rules are in its module docstring, the shared rollout engine,
node model and the one continuation primitive (``Continuing``, ``mix_seed``) in
``train.sampling.base``, the engine that batches every tree at once in
``train.sampling.engine``, the collection job in
``train.sampling.collect``, the Mean@k references in ``train.sampling.references``
and the DSC refresh protocol in ``train.sampling.refresh``.

>>> from train.envs import make_env
>>> from train.sampling import make_sampler
>>> sampler = make_sampler("bel", b_max=3)                           # doctest: +SKIP
>>> tree = sampler.sample_tree(env, policy, task, n_total=16, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

from train.coerce import coerce_fields
from train.sampling.base import (
    SAMPLER_NAMES,
    Budget,
    BudgetError,
    ContinuationError,
    Continuing,
    NodeStart,
    Sampler,
    SamplerConfig,
    SamplerName,
    TreeBuilder,
    action_segments,
    head_entropy,
    mix_seed,
)
from train.sampling.bel import BelConfig, BelSampler, entropy_gap
from train.sampling.caliper import CaliperConfig, CaliperSampler, CaliperState, caliper_extras
from train.sampling.entropy import EntropyConfig, EntropySampler
from train.sampling.group import GroupSampler
from train.sampling.random_branch import RandomBranchConfig, RandomBranchSampler
from train.sampling.rooted import RootedConfig, RootedSampler

SAMPLERS: dict[str, type[Sampler]] = {
    "group": GroupSampler,
    "random": RandomBranchSampler,
    "entropy": EntropySampler,
    "bel": BelSampler,
    "caliper": CaliperSampler,
    "rooted": RootedSampler,
}


def make_sampler(name: str, **params: Any) -> Sampler:
    """A sampler by name with config fields from ``params`` (strings are converted, typed
    values checked, by ``train.coerce.coerce_fields``; a bad one is a ``ValueError``)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose from {list(SAMPLERS)}")
    cls = SAMPLERS[name]
    fields = {f.name: f for f in dataclasses.fields(cls.config_class)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"sampler {name!r} has no options {unknown}; it takes {sorted(fields)}")
    # train.coerce: strings parsed, typed values checked, floats finite
    config = cls.config_class(**coerce_fields(cls.config_class, params, "sampler option "))
    return cls(config)


__all__ = [
    "SAMPLERS",
    "SAMPLER_NAMES",
    "BelConfig",
    "BelSampler",
    "Budget",
    "BudgetError",
    "CaliperConfig",
    "CaliperSampler",
    "CaliperState",
    "ContinuationError",
    "Continuing",
    "EntropyConfig",
    "EntropySampler",
    "GroupSampler",
    "NodeStart",
    "RandomBranchConfig",
    "RandomBranchSampler",
    "RootedConfig",
    "RootedSampler",
    "Sampler",
    "SamplerConfig",
    "SamplerName",
    "TreeBuilder",
    "action_segments",
    "caliper_extras",
    "entropy_gap",
    "head_entropy",
    "make_sampler",
    "mix_seed",
]
