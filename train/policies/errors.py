"""The policy layer's errors and install hint, in a module that imports nothing (issue 28):
the backends (``tiny``, ``vllm_backend``, ``tiny_train``) raise them without importing the
registry in ``train/policies/__init__.py``, which imports the backends (no circle)."""

from __future__ import annotations

INSTALL_HINT = "pip install 'rollout-trees[gpu]'"


class PolicyUnavailableError(RuntimeError):
    """A backend whose optional dependency (vLLM) or checkpoint is missing; the message
    says what to install or run."""


class PolicyRefError(PolicyUnavailableError, ValueError):
    """A stored ``policy_ref`` that no longer reloads the weights that made the trees
    (the checkpoint is gone, damaged, or holds other weights); the message names the
    version. A ``ValueError`` too: bad input, which the CLI prints as a one-line error."""


__all__ = ["INSTALL_HINT", "PolicyRefError", "PolicyUnavailableError"]
