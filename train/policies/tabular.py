"""``tabular``: the exact softmax policy of the workflow environment behind the protocol.

Each workflow action string is ONE token: its id is its index in ``ACTION_VOCAB``
(``fast, careful, repair, skip``, the canonical ``<tool_call>`` strings). In a
state s with valid actions A(s) (``fast, careful, skip`` on a working stage,
``repair, skip`` on a broken one):

* ``logprobs = [log pi(a | s)]`` exactly (``TabularPolicy.log_prob``);
* ``entropies = [H(pi(. | s))]``, the exact entropy of the action distribution;
* sampling at ``temperature`` 1 and ``top_p`` 1 is ``TabularPolicy.sample`` with a
  ``numpy`` generator seeded by ``SampleConfig.seed``; otherwise actions are drawn
  from softmax(logits / temperature) restricted to its ``top_p`` nucleus, and the
  logprobs stay those of the untempered policy, as in the HF backend;
* ``score`` of a string that is not a valid action in s is ``[-inf]`` (probability 0).

The state is parsed from the transcript's last observation (the prompt when there
is none) with ``WorkflowModel.key_from_text``. The policy of a task is looked up by
the transcript's prompt: ``TabularBackend.add(policy)`` registers a
``TabularPolicy`` (its logits) under its model's prompt; an unregistered prompt
gets the uniform policy of a model rebuilt from the prompt (the prompt shows the
stages, their needs and the horizon, which is all a policy over observable states
needs).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence

import numpy as np

from train.envs.workflow_model import (
    ACTION_TEXTS,
    TOOLS,
    ObsKey,
    StageSpec,
    WorkflowModel,
    WorkflowSpec,
)
from train.envs.workflow_policy import TabularPolicy
from train.policies.base import Continuation, SampleConfig, Transcript

ACTION_VOCAB: tuple[str, ...] = tuple(ACTION_TEXTS[tool] for tool in TOOLS)
ACTION_IDS: dict[str, int] = {text: i for i, text in enumerate(ACTION_VOCAB)}

_HEADER_RE = re.compile(r"Run this workflow of (\d+) stages, in order, within (\d+) tool calls:")
_STAGE_RE = re.compile(r"^  (\d+)\. ([a-z][a-z0-9_]*) \(needs: ([^)]*)\)$", re.MULTILINE)
_VALID_RE = re.compile(r"Valid tools: ([a-z, ]+)\.")


def model_from_prompt(prompt: str) -> WorkflowModel:
    """A ``WorkflowModel`` with the prompt's stages, needs and horizon (the tool
    probabilities, which the prompt does not show, are set to 0.5)."""
    header = _HEADER_RE.search(prompt)
    stages = _STAGE_RE.findall(prompt)
    if header is None or not stages or int(header.group(1)) != len(stages):
        raise ValueError(f"not a workflow prompt: {prompt[:80]!r}")
    names = [name for _, name, _ in stages]
    specs = []
    for _, name, needs in stages:
        need_ids = () if needs == "nothing" else tuple(names.index(n.strip())
                                                       for n in needs.split(","))
        specs.append(StageSpec(name=name, needs=need_ids, p_fast=0.5, p_careful=0.5,
                               p_repair=0.5))
    return WorkflowModel(WorkflowSpec(stages=tuple(specs), horizon=int(header.group(2))))


class TabularBackend:
    """The ``tabular`` policy backend (module docstring)."""

    action_vocab: tuple[str, ...] = ACTION_VOCAB

    def __init__(self, policies: Sequence[TabularPolicy] = ()) -> None:
        self._policies: dict[str, TabularPolicy] = {}
        for policy in policies:
            self.add(policy)

    def add(self, policy: TabularPolicy) -> None:
        """Use ``policy`` for transcripts whose prompt is its model's prompt."""
        self._policies[policy.model.prompt()] = policy

    def policy_for(self, transcript: Transcript) -> TabularPolicy:
        """The registered policy of the transcript's prompt, else a uniform one."""
        if not transcript or transcript[0][0] != "prompt":
            raise ValueError("a transcript starts with its prompt")
        prompt = transcript[0][1]
        found = self._policies.get(prompt)
        if found is None:
            found = TabularPolicy(model_from_prompt(prompt))
            self._policies[prompt] = found
        return found

    @staticmethod
    def state_key(policy: TabularPolicy, transcript: Transcript) -> ObsKey:
        """The observable state after the transcript's last turn."""
        role, text = transcript[-1]
        if role == "action":
            raise ValueError("the transcript ends with an action; the next state is unknown")
        key = policy.model.key_from_text(text)
        if key is None:
            raise ValueError(f"no workflow state in the last observation {text[-120:]!r} "
                             "(is the episode over?)")
        return key

    # ----- identity -------------------------------------------------------------------

    @property
    def policy_version(self) -> str:
        """A hash of every registered task's logits (uniform tasks contribute nothing)."""
        table = sorted((prompt, sorted((list(key), sorted(row.items()))
                                       for key, row in policy.state_dict().items()))
                       for prompt, policy in self._policies.items() if policy.state_dict())
        digest = hashlib.sha256(json.dumps(table).encode()).hexdigest()[:12]
        return f"tabular-{digest}"

    @property
    def policy_ref(self) -> str | None:
        """``"tabular"`` while every registered policy is uniform (``load_policy("tabular")``
        then reloads exactly these logits); None once any holds learned logits, which
        live in memory only."""
        if any(policy.state_dict() for policy in self._policies.values()):
            return None
        return "tabular"

    # ----- protocol -------------------------------------------------------------------

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = np.random.default_rng(config.seed)
        results = []
        for transcript in transcripts:
            policy = self.policy_for(transcript)
            key = self.state_key(policy, transcript)
            actions = policy.model.valid_actions(key)
            entropy = policy.entropy(key)
            draw_probs = self._draw_probs(policy, key, config)
            conts = []
            for _ in range(config.n):
                if draw_probs is None:
                    action = policy.sample(key, rng)
                else:
                    action = actions[int(rng.choice(len(actions), p=draw_probs))]
                conts.append(Continuation(
                    text=action, token_ids=[ACTION_IDS[action]],
                    logprobs=[policy.log_prob(key, action)], entropies=[entropy],
                    meta={"temperature": config.temperature, "top_p": config.top_p}))
            results.append(conts)
        return results

    @staticmethod
    def _draw_probs(policy: TabularPolicy, key: ObsKey, config: SampleConfig
                    ) -> np.ndarray | None:
        """The distribution actions are drawn from, or None for the policy itself."""
        if config.temperature == 1.0 and config.top_p == 1.0:
            return None
        logits = np.asarray(policy.logits(key), dtype=np.float64) / config.temperature
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        drop = order[before >= config.top_p]
        probs[drop] = 0.0
        return probs / probs.sum()

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        if len(transcripts) != len(actions):
            raise ValueError(f"{len(transcripts)} transcripts but {len(actions)} actions")
        out = []
        for transcript, action in zip(transcripts, actions, strict=True):
            policy = self.policy_for(transcript)
            key = self.state_key(policy, transcript)
            valid = action in policy.model.valid_actions(key)
            out.append(np.array([policy.log_prob(key, action) if valid else -math.inf],
                                dtype=np.float64))
        return out


class UniformWorkflowPolicy:
    """Uniform over the valid tools named in the last observation's ``Valid tools:`` line
    (needs no task, no model): one token per action (its index in ``TOOLS``), logprob
    -log |A(s)| and entropy log |A(s)|, actions drawn with ``numpy`` seeded by
    ``SampleConfig.seed``. Picklable, so worker processes can build it."""

    policy_ref = None

    def __init__(self, policy_version: str = "uniform-workflow") -> None:
        self.policy_version = policy_version

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = np.random.default_rng(config.seed)
        out = []
        for tr in transcripts:
            tools = [t.strip() for t in _VALID_RE.findall(tr[-1][1])[-1].split(",")]
            h = math.log(len(tools))
            picks = rng.integers(0, len(tools), config.n)
            out.append([Continuation(ACTION_TEXTS[tools[int(i)]],
                                     [TOOLS.index(tools[int(i)])], [-h], [h]) for i in picks])
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        raise NotImplementedError("UniformWorkflowPolicy only samples")
