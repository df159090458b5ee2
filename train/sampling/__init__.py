"""Samplers: one task and a rollout budget ``n_total`` in, one rollout ``Tree`` out (issue 6).

``make_sampler(name, **params)`` builds one by name (``SAMPLERS``); each
sampler's budget rules are in its module docstring, the shared rollout engine,
node model and ``mix_seed`` in ``train.sampling.base``, the one continuation primitive
(``Continuing``) in ``train.sampling.continuation``, the engine that batches every tree at once in
``train.sampling.engine``, the collection job in
``train.sampling.collect``, the Mean@k references in ``train.sampling.references``
and the DSC refresh protocol in ``train.sampling.refresh``.

Names are resolved lazily (``from train.sampling import make_sampler`` loads the registry
and the samplers, not the collection job, Ray or the references); ``_WHERE`` below is the
one place that says which module defines each public name.

>>> from train.envs import make_env
>>> from train.sampling import make_sampler
>>> sampler = make_sampler("bel", b_max=3)                           # doctest: +SKIP
>>> tree = sampler.sample_tree(env, policy, task, n_total=16, seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

from rollout_store.lazy import lazy_face

_WHERE = {
    ".registry": ("SAMPLERS", "make_sampler"),
    ".base": ("SAMPLER_NAMES", "Budget", "BudgetError", "Sampler", "SamplerConfig",
             "SamplerName", "TreeBuilder", "action_segments", "head_entropy", "mix_seed"),
    ".continuation": ("ContinuationError", "Continuing", "NodeStart"),
    ".bel": ("BelConfig", "BelSampler", "entropy_gap"),
    ".caliper": ("CaliperConfig", "CaliperSampler", "CaliperState", "caliper_extras"),
    ".entropy": ("EntropyConfig", "EntropySampler"),
    ".group": ("GroupSampler",),
    ".random_branch": ("RandomBranchConfig", "RandomBranchSampler"),
    ".rooted": ("RootedConfig", "RootedSampler"),
    ".collect": ("CollectReport", "collect"),
    ".references": ("ReferenceConfig", "ReferenceReport", "collect_references"),
}
__getattr__, __all__ = lazy_face("train.sampling", _WHERE)
