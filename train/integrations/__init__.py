"""Adapters that log other frameworks' training runs into a store (``trl``: TRL's
``GRPOTrainer``, needs ``pip install 'rollout-trees[trl]'``)."""
