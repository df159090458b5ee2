"""Adapters that make third-party environment suites tool worlds of ``train.envs``.

Each module imports its third-party package at its top, so importing this package costs
nothing and a missing package fails only when its adapter is resolved (``make_env``
turns the ``ImportError`` into an ``EnvSpecError`` naming the extra to install):

* ``train.envs.adapters.gymnasium_env``: gymnasium's toy-text games (FrozenLake, Taxi,
  CliffWalking, Blackjack) as text boards driven by one ``act`` tool (extra ``gym``);
* ``train.envs.adapters.reasoning_gym_env``: reasoning-gym's procedural task sets
  answered with a ``calc`` tool and graded by the data set's own ``score_answer``
  (extra ``reasoning-gym``).
"""
