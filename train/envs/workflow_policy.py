"""``TabularPolicy``: an exact softmax policy over the observable states of one workflow task.

π(a | s) = softmax(logits[s])[a] over the valid tools of the observable state
s = (stage, steps used, broken) (``ObsKey``); logits default to 0 (uniform).
It never sees the hidden ``corrupt`` flag, so it is also a valid policy for the
text interface, and ``policy.action_probs`` has the ``action_probs(state_text,
valid_action_texts)`` signature of ``lm_policy_values``. The policies issue wraps
it as the ``tabular`` backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, cast

from train.envs.workflow_model import (
    ACTION_TEXTS,
    TOOLS,
    ObsKey,
    PolicyValues,
    State,
    Tool,
    WorkflowModel,
)

_TOOL_BY_TEXT: dict[str, Tool] = {text: tool for tool, text in ACTION_TEXTS.items()}


class UniformSource(Protocol):
    """Anything with ``random() -> float`` in [0, 1): ``random.Random``, numpy ``Generator``."""

    def random(self) -> float: ...


class TabularPolicy:
    """Per-state logits over the valid tools, exact probabilities, explicit updates.

    States may be given as a full ``State`` (its observable part is used) or an
    ``ObsKey``; actions as a tool name (``"fast"``) or its canonical action string.
    """

    def __init__(self, model: WorkflowModel,
                 logits: Mapping[ObsKey, Mapping[str, float]] | None = None) -> None:
        self.model = model
        self._logits: dict[ObsKey, dict[Tool, float]] = {}
        for key, row in (logits or {}).items():
            for action, value in row.items():
                self._set(key, action, float(value))

    # ----- keys -------------------------------------------------------------------------

    def key(self, state: State | ObsKey) -> ObsKey:
        key = state if isinstance(state, ObsKey) else self.model.observe(state)
        if not self.model.valid_tools(key):
            raise ValueError(f"{state} is terminal: no actions")
        return key

    def tools(self, state: State | ObsKey) -> tuple[Tool, ...]:
        return self.model.valid_tools(self.key(state))

    def _tool(self, key: ObsKey, action: str) -> Tool:
        tool = _TOOL_BY_TEXT.get(action, cast(Tool, action))
        if tool not in self.model.valid_tools(key):
            raise ValueError(f"action {action[:60]!r} is not valid in {key}")
        return tool

    def _set(self, state: State | ObsKey, action: str, value: float) -> None:
        key = self.key(state)
        self._logits.setdefault(key, {})[self._tool(key, action)] = value

    # ----- parameters -------------------------------------------------------------------

    def logits(self, state: State | ObsKey) -> list[float]:
        """Logits aligned with ``model.valid_actions(state)``."""
        key = self.key(state)
        row = self._logits.get(key, {})
        return [row.get(tool, 0.0) for tool in self.model.valid_tools(key)]

    def set_logits(self, state: State | ObsKey,
                   logits: Sequence[float] | Mapping[str, float]) -> None:
        """Set a state's logits, as a list aligned with the valid actions or a mapping."""
        key = self.key(state)
        if isinstance(logits, Mapping):
            for action, value in logits.items():
                self._set(key, action, float(value))
            return
        tools = self.model.valid_tools(key)
        if len(logits) != len(tools):
            raise ValueError(f"{key} has {len(tools)} valid actions, got {len(logits)} logits")
        self._logits[key] = {tool: float(v) for tool, v in zip(tools, logits, strict=True)}

    def update(self, state: State | ObsKey, action: str, delta: float) -> None:
        """logits[state][action] += delta."""
        key = self.key(state)
        tool = self._tool(key, action)
        row = self._logits.setdefault(key, {})
        row[tool] = row.get(tool, 0.0) + float(delta)

    def copy(self) -> TabularPolicy:
        clone = TabularPolicy(self.model)
        clone._logits = {key: dict(row) for key, row in self._logits.items()}
        return clone

    def state_dict(self) -> dict[ObsKey, dict[Tool, float]]:
        """The non-default logits (a copy)."""
        return {key: dict(row) for key, row in self._logits.items()}

    # ----- probabilities ----------------------------------------------------------------

    def probs(self, state: State | ObsKey) -> list[float]:
        """π(· | state), aligned with ``model.valid_actions(state)``."""
        logits = self.logits(state)
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]

    def prob(self, state: State | ObsKey, action: str) -> float:
        key = self.key(state)
        tool = self._tool(key, action)
        return self.probs(key)[self.model.valid_tools(key).index(tool)]

    def log_prob(self, state: State | ObsKey, action: str) -> float:
        key = self.key(state)
        tool = self._tool(key, action)
        logits = self.logits(key)
        top = max(logits)
        log_z = top + math.log(sum(math.exp(x - top) for x in logits))
        return logits[self.model.valid_tools(key).index(tool)] - log_z

    def entropy(self, state: State | ObsKey) -> float:
        return -sum(p * math.log(p) for p in self.probs(state) if p > 0.0)

    def sample(self, state: State | ObsKey, rng: UniformSource) -> str:
        """One action string drawn from π(· | state) with one ``rng.random()`` draw."""
        key = self.key(state)
        u = rng.random()
        cumulative = 0.0
        probs = self.probs(key)
        actions = self.model.valid_actions(key)
        for action, p in zip(actions, probs, strict=True):
            cumulative += p
            if u < cumulative:
                return action
        return actions[max(i for i, p in enumerate(probs) if p > 0.0)]

    def action_probs(self, state_text: str, valid_action_texts: list[str]) -> list[float]:
        """The ``lm_policy_values`` callable interface: probabilities of the given action
        strings in the state that ``state_text`` describes (its last state line)."""
        key = self.model.keys_by_text().get(state_text) or self.model.key_from_text(state_text)
        if key is None:
            raise ValueError(f"no workflow state line in {state_text[:80]!r}")
        probs = dict(zip(self.model.valid_actions(key), self.probs(key), strict=True))
        return [probs.get(text, 0.0) for text in valid_action_texts]

    # ----- exact values -----------------------------------------------------------------

    def values(self) -> PolicyValues:
        """Exact V_π / Q_π of a frozen copy of this policy (later updates don't leak in)."""
        frozen = self.copy()
        return PolicyValues(self.model, lambda s: (frozen.probs(s), 0.0))


def policy_values(policy: TabularPolicy) -> PolicyValues:
    """Exact V_π / Q_π by dynamic programming (see ``PolicyValues``)."""
    return policy.values()


__all__ = ["TOOLS", "TabularPolicy", "UniformSource", "policy_values"]
