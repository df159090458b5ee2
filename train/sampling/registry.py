"""The sampler registry: ``SAMPLERS`` (name -> class) and ``make_sampler(name, **params)``."""

from __future__ import annotations

import dataclasses
from typing import Any

from train.coerce import coerce_fields
from train.sampling.base import Sampler
from train.sampling.bel import BelSampler
from train.sampling.caliper import CaliperSampler
from train.sampling.entropy import EntropySampler
from train.sampling.group import GroupSampler
from train.sampling.random_branch import RandomBranchSampler
from train.sampling.rooted import RootedSampler

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


__all__ = ["SAMPLERS", "make_sampler"]
