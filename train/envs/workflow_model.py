"""The exact model behind the ``workflow`` environment: task spec, states, text, values.

Everything here is pure and finite, so every quantity is exact (no sampling):

* ``WorkflowSpec`` / ``StageSpec``: one task (a small DAG of stages, a horizon);
* ``State``: the full environment state, ``ObsKey``: the part the agent sees;
* ``WorkflowModel``: transitions, rendering, recoverability, path replay, and
  the ground truth for BEL (METHODS.md §2.1): ``first_irrecoverable_step``;
* ``PolicyValues`` / ``OptimalValues``: V and Q by dynamic programming over the
  finite state space (DSC-Gate's Q_μ(s, h, u) and V; METHODS.md §5, D1-D2: a
  state here carries its step count, so h = horizon - t);
* ``lm_policy_values``: the same dynamic program for any callable
  ``action_probs(state_text, valid_action_texts)``, e.g. a language model
  scoring each valid action string.

The rules (states, tools, outcomes) are documented in ``train.envs.workflow``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

from train.envs.base import error_response, parse_action, tool_response

Tool = Literal["fast", "careful", "repair", "skip"]
TOOLS: tuple[Tool, ...] = ("fast", "careful", "repair", "skip")
FastFailure = Literal["broken", "crash"]
# What lm_policy_values does with probability mass outside the valid action strings.
ResidualMode = Literal["renormalize", "wasted", "strict"]
ActionProbs = Callable[[str, list[str]], Sequence[float]]

MAX_HORIZON = 200  # the value recursion goes one Python frame level per step
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_STATE_RE = re.compile(
    r"Stage (\d+)/(\d+): [a-z][a-z0-9_]* \(needs: [^)]*\)\. Status: (ok|broken)\. "
    r"Steps left: (\d+)\.")
_OUTCOME_RE = re.compile(r"^<tool_response>(fast|careful|repair|skip) on '[a-z0-9_]*': "
                         r"(success|failure)\.")
_PROB_TOL = 1e-6


def action_text(tool: str) -> str:
    """The canonical action string for ``tool``: ``<tool_call>{"name": ..., "arguments": {}}``."""
    return "<tool_call>" + json.dumps({"name": tool, "arguments": {}}) + "</tool_call>"


ACTION_TEXTS: dict[Tool, str] = {tool: action_text(tool) for tool in TOOLS}


@dataclass(frozen=True)
class StageSpec:
    """One stage of the workflow DAG.

    ``needs`` lists earlier stage indices this stage depends on (the DAG edges);
    ``p_*`` are the success probabilities of the tools; ``fast_failure`` is what
    a failed ``fast`` does: ``broken`` (repairable) or ``crash`` (episode over).
    """

    name: str
    needs: tuple[int, ...]
    p_fast: float
    p_careful: float
    p_repair: float
    fast_failure: FastFailure = "broken"


@dataclass(frozen=True)
class WorkflowSpec:
    """One task: stages in execution (topological) order, a horizon, the RNG seed.

    The last stage is the goal. A stage is *required* when it is the last stage
    or the last stage depends on it, directly or through other stages; the
    others are optional and may be skipped safely.
    """

    stages: tuple[StageSpec, ...]
    horizon: int
    rng_seed: int = 0
    deterministic: bool = False
    mark_optional: bool = False

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a workflow needs at least one stage")
        if not 1 <= self.horizon <= MAX_HORIZON:
            raise ValueError(f"horizon must be in 1..{MAX_HORIZON}, got {self.horizon}")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            if not _NAME_RE.match(stage.name):
                raise ValueError(f"stage name {stage.name!r} must match {_NAME_RE.pattern}")
            if any(not 0 <= j < i for j in stage.needs):
                raise ValueError(f"stage {i} ({stage.name}) may only need earlier stages, "
                                 f"got {list(stage.needs)}")
            for p in (stage.p_fast, stage.p_careful, stage.p_repair):
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"stage {stage.name}: probability {p} outside [0, 1]")
            if stage.fast_failure not in ("broken", "crash"):
                raise ValueError(f"stage {stage.name}: fast_failure must be 'broken' or 'crash'")

    def required(self) -> frozenset[int]:
        """Indices of the last stage and of every stage it transitively needs."""
        last = len(self.stages) - 1
        found, todo = {last}, [last]
        while todo:
            for j in self.stages[todo.pop()].needs:
                if j not in found:
                    found.add(j)
                    todo.append(j)
        return frozenset(found)

    def to_config(self) -> dict[str, Any]:
        """The JSON-able ``Task.config`` form."""
        return {
            "horizon": self.horizon, "rng_seed": self.rng_seed,
            "deterministic": self.deterministic,
            **({"mark_optional": True} if self.mark_optional else {}),
            "stages": [{"name": s.name, "needs": list(s.needs), "p_fast": s.p_fast,
                        "p_careful": s.p_careful, "p_repair": s.p_repair,
                        "fast_failure": s.fast_failure} for s in self.stages],
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> WorkflowSpec:
        try:
            stages = tuple(
                StageSpec(name=str(s["name"]), needs=tuple(int(j) for j in s.get("needs", ())),
                          p_fast=float(s["p_fast"]), p_careful=float(s["p_careful"]),
                          p_repair=float(s["p_repair"]),
                          fast_failure=s.get("fast_failure", "broken"))
                for s in config["stages"])
            return cls(stages=stages, horizon=int(config["horizon"]),
                       rng_seed=int(config.get("rng_seed", 0)),
                       deterministic=bool(config.get("deterministic", False)),
                       mark_optional=bool(config.get("mark_optional", False)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"bad workflow task config: {exc!r}") from exc

    def to_compact(self) -> list[Any]:
        """A short list form for snapshots: ``[horizon, rng_seed, [[name, needs, p_fast,
        p_careful, p_repair, "b"|"c"], ...]]``, plus a trailing ``1`` when
        ``mark_optional`` (``deterministic`` travels separately)."""
        return [self.horizon, self.rng_seed,
                [[s.name, list(s.needs), s.p_fast, s.p_careful, s.p_repair,
                  s.fast_failure[0]] for s in self.stages], *([1] if self.mark_optional else [])]

    @classmethod
    def from_compact(cls, data: Any, deterministic: bool = False) -> WorkflowSpec:
        try:
            horizon, rng_seed, stages, *marked = data
            if marked not in ([], [1]):
                raise ValueError(f"unexpected trailing fields {marked}")
            return cls(
                stages=tuple(StageSpec(str(n), tuple(int(j) for j in needs), float(pf),
                                       float(pc), float(pr),
                                       "crash" if ff == "c" else "broken")
                             for n, needs, pf, pc, pr, ff in stages),
                horizon=int(horizon), rng_seed=int(rng_seed), deterministic=deterministic,
                mark_optional=bool(marked))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad compact workflow spec: {exc}") from exc


class State(NamedTuple):
    """The full state. ``stage == n_stages`` once the last stage is done or skipped.

    ``corrupt`` is hidden from the agent: a required stage was skipped, so the
    final check will fail. ``crashed``: a ``fast`` call crashed the workflow.
    """

    stage: int
    t: int  # steps used, malformed actions included
    broken: bool = False
    corrupt: bool = False
    crashed: bool = False


class ObsKey(NamedTuple):
    """What the agent sees of a non-terminal state (the tabular policy's key)."""

    stage: int
    t: int
    broken: bool


class Transition(NamedTuple):
    probability: float
    state: State


class WorkflowModel:
    """Exact dynamics of one workflow task (see ``train.envs.workflow`` for the rules).

    ``deterministic=None`` takes the spec's flag. In deterministic mode a tool
    succeeds iff its success probability is >= 0.5, so every transition has
    probability 0 or 1.
    """

    def __init__(self, spec: WorkflowSpec, deterministic: bool | None = None) -> None:
        self.spec = spec
        self.deterministic = spec.deterministic if deterministic is None else deterministic
        self.n_stages = len(spec.stages)
        self.horizon = spec.horizon
        self.required = spec.required()
        self._recoverable: dict[State, bool] = {}
        self._optimal: OptimalValues | None = None
        self._keys_by_text: dict[str, ObsKey] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], deterministic: bool | None = None
                    ) -> WorkflowModel:
        return cls(WorkflowSpec.from_config(config), deterministic)

    # ----- states and tools -------------------------------------------------------------

    def initial_state(self) -> State:
        return State(0, 0)

    def is_terminal(self, s: State) -> bool:
        return s.crashed or s.stage >= self.n_stages or s.t >= self.horizon

    def is_success(self, s: State) -> bool:
        return s.stage >= self.n_stages and not s.corrupt and not s.crashed

    def reward(self, s: State) -> float:
        """1.0 in a successful terminal state, else 0.0."""
        return 1.0 if self.is_success(s) else 0.0

    def observe(self, s: State) -> ObsKey:
        return ObsKey(s.stage, s.t, s.broken)

    def valid_tools(self, s: State | ObsKey) -> tuple[Tool, ...]:
        """``fast, careful, skip`` on a working stage, ``repair, skip`` on a broken one,
        nothing in a terminal state."""
        if isinstance(s, ObsKey):
            s = State(s.stage, s.t, s.broken)
        if self.is_terminal(s):
            return ()
        return ("repair", "skip") if s.broken else ("fast", "careful", "skip")

    def valid_actions(self, s: State | ObsKey) -> list[str]:
        """The canonical action strings of the valid tools, in ``TOOLS`` order."""
        return [ACTION_TEXTS[tool] for tool in self.valid_tools(s)]

    def tool_probability(self, s: State, tool: Tool) -> float:
        """Probability that ``tool`` succeeds in ``s`` (0/1 in deterministic mode)."""
        stage = self.spec.stages[s.stage]
        p = {"fast": stage.p_fast, "careful": stage.p_careful, "repair": stage.p_repair,
             "skip": 1.0}[tool]
        if self.deterministic:
            return 1.0 if p >= 0.5 else 0.0
        return p

    def outcomes(self, s: State, tool: Tool) -> tuple[float, State, State]:
        """``(p_success, state on success, state on failure)`` of a valid tool."""
        if tool not in self.valid_tools(s):
            raise ValueError(f"tool {tool!r} is not valid in {s}")
        t1 = s.t + 1
        p = self.tool_probability(s, tool)
        advanced = State(s.stage + 1, t1, False, s.corrupt)
        if tool == "fast":
            crash = self.spec.stages[s.stage].fast_failure == "crash"
            failed = s._replace(t=t1, crashed=True) if crash else s._replace(t=t1, broken=True)
            return p, advanced, failed
        if tool == "careful":
            return p, advanced, s._replace(t=t1)
        if tool == "repair":
            return p, s._replace(t=t1, broken=False), s._replace(t=t1)
        skipped = advanced._replace(corrupt=s.corrupt or s.stage in self.required)
        return p, skipped, skipped

    def wasted(self, s: State) -> State:
        """The state after a malformed or invalid action: one step used, nothing else."""
        return s._replace(t=s.t + 1)

    def classify(self, s: State, text: str) -> tuple[Tool | None, str | None]:
        """``(tool, None)`` for a valid call in ``s``, else ``(None, error message)``."""
        try:
            parsed = parse_action(text)
        except (RecursionError, ValueError) as exc:  # e.g. JSON nested past the parser's depth
            return None, f"unreadable action ({type(exc).__name__})"
        if parsed.kind == "answer":
            return None, "this workflow takes no <answer>; call a tool"
        if parsed.kind != "tool_call" or parsed.name is None:
            return None, parsed.error or "malformed action"
        valid = self.valid_tools(s)
        if parsed.name not in TOOLS:
            return None, f"unknown tool {parsed.name[:40]!r}; valid tools: {', '.join(valid)}"
        if parsed.arguments:
            return None, f"tool {parsed.name!r} takes no arguments"
        if parsed.name not in valid:
            return None, (f"tool {parsed.name!r} is not valid here; "
                          f"valid tools: {', '.join(valid)}")
        return cast(Tool, parsed.name), None

    def transitions(self, s: State, action: str) -> list[Transition]:
        """Next states of any action text (a tool name is accepted too), zero-probability
        outcomes dropped; a malformed or invalid action wastes a step."""
        if self.is_terminal(s):
            raise ValueError(f"{s} is terminal")
        tool = cast(Tool, action) if action in TOOLS and action in self.valid_tools(s) \
            else self.classify(s, action)[0]
        if tool is None:
            return [Transition(1.0, self.wasted(s))]
        p, success, failure = self.outcomes(s, tool)
        if success == failure:
            return [Transition(1.0, success)]
        return [tr for tr in (Transition(p, success), Transition(1.0 - p, failure))
                if tr.probability > 0.0]

    def reachable_states(self, roots: Iterable[State] | None = None,
                         include_wasted: bool = False) -> list[State]:
        """States reachable from ``roots`` (default: the initial state) through valid tools
        (and malformed actions too with ``include_wasted``), sorted."""
        todo = list(roots) if roots is not None else [self.initial_state()]
        seen = set(todo)
        while todo:
            s = todo.pop()
            if self.is_terminal(s):
                continue
            nxt = [tr.state for tool in self.valid_tools(s) for tr in self.transitions(s, tool)]
            if include_wasted:
                nxt.append(self.wasted(s))
            for s2 in nxt:
                if s2 not in seen:
                    seen.add(s2)
                    todo.append(s2)
        return sorted(seen)

    # ----- recoverability and the BEL ground truth ------------------------------------

    def recoverable(self, s: State) -> bool:
        """Success probability > 0 under some policy (exact, by reachability, no floats).

        A state is irrecoverable when it is a failed terminal state, when a required
        stage was skipped (``corrupt``), or when no positive-probability sequence of
        outcomes finishes the remaining stages within the steps left.
        """
        found = self._recoverable.get(s)
        if found is None:
            if self.is_terminal(s):
                found = self.is_success(s)
            elif s.corrupt:
                found = False
            else:
                found = any(self.recoverable(tr.state) for tool in self.valid_tools(s)
                            for tr in self.transitions(s, tool))
            self._recoverable[s] = found
        return found

    def first_irrecoverable_step(self, states: Sequence[State]) -> int | None:
        """BEL's ground truth t_crit (METHODS.md §2.1): for a trajectory's states
        ``s_0 .. s_K`` (``s_k`` after step k), the smallest k with ``s_k`` irrecoverable,
        i.e. the 1-based index of the step after which success is impossible.

        0 when the start state is already irrecoverable; None when every state is
        recoverable (in particular for a successful trajectory). Recoverability is
        monotone along any realized trajectory, so every later state is irrecoverable too.
        """
        for k, s in enumerate(states):
            if not self.recoverable(s):
                return k
        return None

    # ----- replaying paths --------------------------------------------------------------

    def step_state(self, s: State, text: str, success: bool | None) -> State:
        """The next state after action ``text`` with the given tool outcome.

        ``success`` is ignored for malformed or invalid actions and for tools whose
        outcome is certain; otherwise it is needed (ValueError when None or when the
        outcome has probability 0).
        """
        if self.is_terminal(s):
            raise ValueError(f"action after the episode ended (state {s})")
        tool, _ = self.classify(s, text)
        if tool is None:
            return self.wasted(s)
        p, on_success, on_failure = self.outcomes(s, tool)
        if on_success == on_failure:
            return on_success
        if success is None:
            if p in (0.0, 1.0):
                return on_success if p == 1.0 else on_failure
            raise ValueError(f"the outcome of {tool} in {s} is random; pass it")
        if p == (0.0 if success else 1.0):
            raise ValueError(f"{tool} in {s} cannot {'succeed' if success else 'fail'}")
        return on_success if success else on_failure

    def replay(self, action_texts: Sequence[str],
               outcomes: Sequence[bool | None] | None = None,
               start: State | None = None) -> list[State]:
        """States ``s_0 .. s_K`` along a path of action texts and tool outcomes.

        ``outcomes[k]`` says whether step k's tool succeeded (None where it does not
        matter); ``outcomes=None`` works when every outcome is certain, e.g. in
        deterministic mode.
        """
        if outcomes is not None and len(outcomes) != len(action_texts):
            raise ValueError("need one outcome per action")
        states = [start if start is not None else self.initial_state()]
        for k, text in enumerate(action_texts):
            success = outcomes[k] if outcomes is not None else None
            states.append(self.step_state(states[-1], text, success))
        return states

    @staticmethod
    def parse_outcome(observation: str) -> bool | None:
        """The tool outcome an observation reports (None for an error observation)."""
        match = _OUTCOME_RE.match(observation)
        return None if match is None else match.group(2) == "success"

    def path_states(self, action_texts: Sequence[str], observation_texts: Sequence[str],
                    start: State | None = None) -> list[State]:
        """States along a tree path given as the nodes' action and observation texts."""
        if len(observation_texts) != len(action_texts):
            raise ValueError("need one observation per action")
        return self.replay(action_texts, [self.parse_outcome(o) for o in observation_texts],
                           start)

    def tree_states(self, node_ids: Sequence[int], parent_ids: Sequence[int | None],
                    action_texts: Sequence[str], observation_texts: Sequence[str]
                    ) -> dict[int, State]:
        """The state at every node of a rollout tree, from its columns (any node order).

        A node without a parent is the root (its observation is the prompt, its state
        the initial state); every other node is one step: its action text, and the
        observation that reports the tool outcome.
        """
        index = {nid: i for i, nid in enumerate(node_ids)}
        states: dict[int, State] = {}
        for start in node_ids:
            chain: list[int] = []
            nid = start
            while nid not in states:
                if nid not in index or len(chain) > len(node_ids):
                    raise ValueError(f"node {start}: missing parent {nid} or a cycle")
                parent = parent_ids[index[nid]]
                if parent is None:
                    states[nid] = self.initial_state()
                    break
                chain.append(nid)
                nid = parent
            for nid in reversed(chain):
                i = index[nid]
                parent = parent_ids[i]
                assert parent is not None
                states[nid] = self.step_state(states[parent], action_texts[i],
                                              self.parse_outcome(observation_texts[i]))
        return states

    # ----- text ---------------------------------------------------------------------------

    def _needs_text(self, i: int) -> str:
        """What follows ``needs:`` for stage ``i``: the stages it needs, and ``; optional``
        when the task marks its optional stages (``mark_optional``) and ``i`` is one."""
        needs = self.spec.stages[i].needs
        text = ", ".join(self.spec.stages[j].name for j in needs) if needs else "nothing"
        if self.spec.mark_optional and i not in self.required:
            text += "; optional"
        return text

    def state_text(self, s: State | ObsKey) -> str:
        """The line describing a non-terminal state; it ends every observation and is
        what ``action_probs`` callables receive. It shows exactly ``observe(s)``."""
        if isinstance(s, ObsKey):
            s = State(s.stage, s.t, s.broken)
        if self.is_terminal(s):
            return self.end_text(s)
        status = "broken" if s.broken else "ok"
        return (f"Stage {s.stage + 1}/{self.n_stages}: {self.spec.stages[s.stage].name} "
                f"(needs: {self._needs_text(s.stage)}). Status: {status}. "
                f"Steps left: {self.horizon - s.t}. "
                f"Valid tools: {', '.join(self.valid_tools(s))}.")

    def end_text(self, s: State) -> str:
        if self.is_success(s):
            return "Workflow complete. Reward 1."
        if s.crashed:
            return "The workflow crashed. Reward 0."
        if s.stage >= self.n_stages:
            return "Final check failed: a required stage was skipped. Reward 0."
        return "Out of steps. Reward 0."

    def key_from_text(self, text: str) -> ObsKey | None:
        """The observable state described by the last state line in ``text``."""
        matches = list(_STATE_RE.finditer(text))
        if not matches:
            return None
        stage, n, status, left = matches[-1].groups()
        if int(n) != self.n_stages:
            return None
        key = ObsKey(int(stage) - 1, self.horizon - int(left), status == "broken")
        if not (0 <= key.stage < self.n_stages and 0 <= key.t < self.horizon):
            return None
        return key

    def prompt(self) -> str:
        """The first observation: the task, the DAG, the tools, the first state line."""
        lines = [f"Run this workflow of {self.n_stages} stages, in order, within "
                 f"{self.horizon} tool calls:"]
        lines += [f"  {i + 1}. {st.name} (needs: {self._needs_text(i)})"
                  for i, st in enumerate(self.spec.stages)]
        lines += [
            "It succeeds when the last stage is done and no stage it depends on, directly "
            "or indirectly, was skipped.",
            "Call one tool per step: <tool_call>{\"name\": TOOL, \"arguments\": {}}</tool_call>",
            "  fast: run the current stage quickly; on failure the stage breaks (or the "
            "workflow crashes).",
            "  careful: run the current stage carefully; on failure nothing changes.",
            "  repair: fix a broken stage.",
            "  skip: move on without running the current stage.",
            self.state_text(self.initial_state()),
        ]
        return "\n".join(lines)

    def render_step(self, s: State, tool: Tool | None, error: str | None,
                    success: bool, s2: State) -> str:
        """The observation after one step from ``s`` to ``s2``."""
        tail = self.state_text(s2)
        if tool is None:
            reason = (error or "malformed action").rstrip(".")
            return error_response(f"{reason}. The step was wasted.\n{tail}")
        name = self.spec.stages[s.stage].name
        word = "success" if success else "failure"
        detail = {
            ("fast", True): "", ("careful", True): "",
            ("fast", False): " The workflow crashed." if s2.crashed else " The stage is broken.",
            ("careful", False): " Nothing changed.",
            ("repair", True): " The stage is fixed.", ("repair", False): " Still broken.",
            ("skip", True): " The stage was skipped.", ("skip", False): "",
        }[(tool, success)]
        return tool_response(f"{tool} on '{name}': {word}.{detail}\n{tail}")

    # ----- values -------------------------------------------------------------------------

    def optimal_values(self) -> OptimalValues:
        """V* and Q* (cached): the best success probability from each state."""
        if self._optimal is None:
            self._optimal = OptimalValues(self)
        return self._optimal

    def keys_by_text(self) -> dict[str, ObsKey]:
        """Every non-terminal observable state keyed by its ``state_text``."""
        if self._keys_by_text is None:
            self._keys_by_text = {}
            for stage in range(self.n_stages):
                for t in range(self.horizon):
                    for broken in (False, True):
                        key = ObsKey(stage, t, broken)
                        self._keys_by_text[self.state_text(key)] = key
        return self._keys_by_text


class _ValueTable:
    """Memoized V over states; Q(s, a) = Σ_o P(o | s, a) V(s_o) for any action text."""

    def __init__(self, model: WorkflowModel) -> None:
        self.model = model
        self._v: dict[State, float] = {}

    def v(self, s: State) -> float:
        """Success probability from ``s`` (1.0 / 0.0 in terminal states)."""
        found = self._v.get(s)
        if found is None:
            found = self.model.reward(s) if self.model.is_terminal(s) else self._backup(s)
            self._v[s] = found
        return found

    def q(self, s: State, action: str) -> float:
        """Success probability after taking ``action`` (text or tool name) in ``s``."""
        return sum(tr.probability * self.v(tr.state) for tr in self.model.transitions(s, action))

    def q_values(self, s: State) -> dict[str, float]:
        """Q of every valid action string of ``s``."""
        return {text: self.q(s, text) for text in self.model.valid_actions(s)}

    def table(self, roots: Iterable[State] | None = None) -> dict[State, float]:
        """V of every state reachable from ``roots`` (default: the initial state)."""
        return {s: self.v(s) for s in self.model.reachable_states(roots)}

    def path_value(self, action_texts: Sequence[str],
                   observation_texts: Sequence[str] | None = None,
                   outcomes: Sequence[bool | None] | None = None) -> float:
        """Success probability of continuing from the node a path reaches: the path is
        given by the nodes' action and observation texts (or by explicit outcomes)."""
        if observation_texts is not None:
            return self.v(self.model.path_states(action_texts, observation_texts)[-1])
        return self.v(self.model.replay(action_texts, outcomes)[-1])

    def tree_values(self, node_ids: Sequence[int], parent_ids: Sequence[int | None],
                    action_texts: Sequence[str], observation_texts: Sequence[str]
                    ) -> dict[int, float]:
        """Success probability of continuing from every node of a rollout tree (see
        ``WorkflowModel.tree_states``), keyed by node id."""
        states = self.model.tree_states(node_ids, parent_ids, action_texts, observation_texts)
        return {nid: self.v(s) for nid, s in states.items()}

    def _backup(self, s: State) -> float:
        raise NotImplementedError


class OptimalValues(_ValueTable):
    """V*(s) = max_a Q*(s, a), with full knowledge of the state (hidden flags included)."""

    def _backup(self, s: State) -> float:
        return max(self.q(s, tool) for tool in self.model.valid_tools(s))

    def best_action(self, s: State) -> str:
        """The valid action with the highest Q*; ties go to the first in ``TOOLS`` order."""
        tools = self.model.valid_tools(s)
        if not tools:
            return ACTION_TEXTS["careful"]
        best = max(tools, key=lambda tool: (self.q(s, tool), -TOOLS.index(tool)))
        return ACTION_TEXTS[best]


class PolicyValues(_ValueTable):
    """V_π and Q_π for a policy that depends on the observable state only.

    ``probs_fn(s)`` returns ``(probabilities aligned with valid_actions(s), residual)``:
    the residual mass is an invalid action, which wastes one step.
    V_π(s) = Σ_a π(a|s) Q_π(s, a) + residual · V_π(wasted(s)).
    """

    def __init__(self, model: WorkflowModel,
                 probs_fn: Callable[[State], tuple[list[float], float]]) -> None:
        super().__init__(model)
        self._probs_fn = probs_fn
        self._policy: dict[ObsKey, tuple[list[float], float]] = {}

    def _probs(self, s: State) -> tuple[list[float], float]:
        key = self.model.observe(s)
        found = self._policy.get(key)
        if found is None:
            found = self._probs_fn(s)
            self._policy[key] = found
        return found

    def policy(self, s: State) -> dict[str, float]:
        """π(a | s) over the valid action strings of ``s``."""
        probs, _ = self._probs(s)
        return dict(zip(self.model.valid_actions(s), probs, strict=True))

    def _backup(self, s: State) -> float:
        probs, residual = self._probs(s)
        value = sum(p * self.q(s, text)
                    for p, text in zip(probs, self.model.valid_actions(s), strict=True) if p)
        if residual:
            value += residual * self.v(self.model.wasted(s))
        return value


def lm_policy_values(model: WorkflowModel, action_probs: ActionProbs,
                     residual: ResidualMode = "renormalize") -> PolicyValues:
    """Exact V/Q for a policy given as ``action_probs(state_text, valid_action_texts)``.

    The callable (e.g. a language model's sequence probability of each valid action
    string) is called once per observable state, lazily, with ``model.state_text(s)``
    and ``model.valid_actions(s)``. Mass it leaves outside the valid strings is handled
    by ``residual``: ``renormalize`` (the policy conditioned on a valid action),
    ``wasted`` (the rest is an invalid action that wastes a step; exact when the model
    only ever emits canonical strings or garbage) or ``strict`` (must sum to 1 ± 1e-6).
    """

    def probs_fn(s: State) -> tuple[list[float], float]:
        actions = model.valid_actions(s)
        raw = [float(p) for p in action_probs(model.state_text(s), list(actions))]
        if len(raw) != len(actions):
            raise ValueError(f"action_probs gave {len(raw)} probabilities for "
                             f"{len(actions)} actions")
        if any(not math.isfinite(p) or p < 0.0 for p in raw):
            raise ValueError(f"action_probs gave invalid probabilities {raw}")
        total = sum(raw)
        if residual == "renormalize":
            if total <= 0.0:
                raise ValueError("action_probs gave zero mass to every valid action")
            return [p / total for p in raw], 0.0
        if total > 1.0 + _PROB_TOL or (residual == "strict" and total < 1.0 - _PROB_TOL):
            raise ValueError(f"action_probs sum to {total}, not 1")
        return raw, max(0.0, 1.0 - total) if residual == "wasted" else 0.0

    return PolicyValues(model, probs_fn)
