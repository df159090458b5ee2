"""``sgls``: schema-guided simulated tools with HierR reward parts (SLCA-GRPO, METHODS.md §4).

SLCA-GRPO's SGLS sends each tool call to a large LLM that checks it against the
tool's JSON schema and mocks a response. Here the backend is a deterministic
simulator over a small world state instead, so episodes are exactly
restorable and outcomes have a ground truth. Two worlds, chosen per task
(``Task.config["world"]``); the worlds and task generators live in
``train.envs.sgls_worlds``, the reward in ``train.envs.sgls_reward``.

Tools (names and argument names are public interface; ``*`` = required,
``!`` = irreversible):

* ``shop``: ``search_items(category*, query, max_price)``, ``get_item(item_id*)``,
  ``add_to_cart(item_id*, quantity*)``, ``remove_from_cart(item_id*)``,
  ``view_cart()``, ``place_order(shipping*)`` !, ``pay_order(order_id*, method*)`` !,
  ``get_order(order_id*)``.
* ``flight``: ``search_flights(origin*, destination*, date*)``, ``get_flight(flight_id*)``,
  ``book_flight(flight_id*, passenger*, cabin*)`` !, ``cancel_booking(booking_id*)`` !,
  ``get_booking(booking_id*)``, ``list_bookings(passenger*)``.

Observation format:

* ``reset`` returns the task prompt: the question, then the world's tool schemas
  (one JSON object per line, ``{"name", "description", "parameters"}``), then
  the protocol.
* A tool turn returns one ``<tool_response>...</tool_response>`` per call, in
  call order, joined by newlines. A call that runs answers JSON
  (``<tool_response>{"order_id": "ORD-1A2B3C", ...}</tool_response>``); money is a
  number of dollars. A call that does not run answers
  ``<tool_response>error: ...</tool_response>`` with a deterministic message: bad
  JSON, unknown tool, arguments violating the schema (``check_arguments``),
  or a refusal by the world (unknown id, no stock, empty cart, ...). A refused
  call changes nothing.
* A malformed action (neither block) or an over-long one gets a single
  ``<tool_response>error: ...</tool_response>``; the step still counts.
* The answer step returns ``""`` with ``done=True``. A step after the end
  changes nothing and returns an error observation, ``done=True`` and the final
  reward parts again.

Action format (after ``<think>``/``<thinking>`` blocks are removed):

* A tool turn: the first block is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
  *Every* ``<tool_call>`` block of the action runs, in order (parallel calls;
  at most :data:`MAX_CALLS_PER_TURN`); a block may also hold a JSON list of
  call objects. Text outside the blocks, including a later ``<answer>``, is ignored.
* The final turn: the first block is ``<answer>...</answer>``; the episode ends
  and the reward is computed.
* An action longer than :data:`MAX_ACTION_CHARS` is refused whole and HierR
  never sees it.

Reward (``reward_parts`` of the final step; every other step has only ``reward = 0``):

* HierR over the whole episode (METHODS S2-S4, ``sgls_reward.hierr``):
  ``fmt``, ``name``, ``key``, ``value``, ``par`` against the task's gold calls,
  ``r_tool = 0.10·fmt + 0.25·name + 0.15·key + 0.20·value + 0.30·par``,
  ``r_sum = (rating - 1)/4`` from a :class:`~train.envs.sgls_reward.Judge`
  (default: :class:`~train.envs.sgls_reward.RuleJudge` over the task's facts)
  with the S3 zero rules and the S4 omission guard (no ``<tool_call>`` at all:
  ``r_tool = 0``, ``r_sum = -0.5``). HierR scores what the policy *wrote*: every
  ``<tool_call>`` block of every action counts, even one that was not run. Every
  call's answer, errors included, is a tool response for S3 (the judge sees it);
  the error for a malformed action is not.
* ``reward = (r_tool + r_sum) / 2``, in [-0.25, 1]; the scripted expert gets 1.
* ``success`` (1/0): the episode's irreversible effects equal the gold
  effects (as a multiset) *and* the answer states every fact of the task,
  each also found in some successful tool response. Independent of the
  pluggable judge.
* ``truncated`` (1/0): the step limit ended the episode without an answer.
  Then ``reward = 0`` and the other parts are HierR so far with no reply.

Recoverability (ground truth for localization): a state is recoverable when
some continuation can still reach ``success``: every effect so far is a gold
effect still owed, and the steps left allow one more tool turn (only needed
while effects are owed or a fact is not yet in a successful tool response) plus the
answer. It is monotone along a trajectory. See :meth:`SglsEnv.is_recoverable`
and :meth:`SglsEnv.first_irrecoverable_step`.

Tasks (``SglsEnv.generate_tasks``): ``Task.config`` holds ``world``, ``kind``,
``question``, ``state`` (the initial world state), ``gold`` (steps, each a list
of ``{"name", "arguments"}``), ``gold_effects`` and ``facts``; ``Task.answer`` is
a reference reply stating every fact. Kinds: shop ``buy_cheapest`` (search, add,
place, pay), ``compare_buy`` (two parallel ``get_item``, add, place; paying is
wrong), ``price_check`` (read-only); flight ``book_cheapest``, ``book_earliest``
(search, book), ``cancel`` (list, cancel), ``rebook`` (list + search in
parallel, then cancel + book in parallel).

Snapshot: canonical JSON (sorted keys, compact, ASCII) of the task's gold
data, the world state, the effects, the step count and what HierR needs of the
history (tag counts, calls per turn, tool responses). ``restore`` needs no
replay and no ``reset``.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

from train.envs.base import (
    Environment,
    StepResult,
    Task,
    error_response,
    tool_response,
)
from train.envs.preamble import system_preamble
from train.envs.sgls_phrases import SGLS_OTHER_KEYS, SGLS_STRING_KEYS, SGLS_TEXT_TOKENS
from train.envs.sgls_reward import (
    Call,
    HierR,
    Judge,
    RuleJudge,
    ascii_clip,
    canonical_json,
    first_block,
    grounding_text,
    hierr,
    mentions,
    scan_action,
    strip_think,
)
from train.envs.sgls_worlds import TASK_KINDS, WORLDS, ToolError, World

MAX_ACTION_CHARS = 65_536
# SLCA-GRPO trains with at most 20 parallel calls per turn (METHODS §4, setup).
MAX_CALLS_PER_TURN = 20
# Steps beyond the gold tool turns and the answer that a task allows.
STEP_SLACK = 3
SNAPSHOT_VERSION = 1

_PROTOCOL = (
    "Call a tool with <tool_call>{\"name\": \"...\", \"arguments\": {...}}</tool_call>; "
    "several <tool_call> blocks in one turn run in order. Each call is answered with "
    "<tool_response>...</tool_response>. When you are done, reply to the user with "
    "<answer>...</answer>."
)


def render_prompt(world: World, question: str) -> str:
    """The first observation: question, tool schemas (one JSON per line), protocol."""
    tools = "\n".join(json.dumps(t.schema()) for t in world.tools.values())
    return f"{question}\n\nTools:\n{tools}\n\n{_PROTOCOL}"


def _effect_counts(effects: Sequence[Any]) -> Counter[str]:
    return Counter(canonical_json(e) for e in effects)


class SglsEnv(Environment):
    """Schema-guided simulated tool worlds (shop, flight) with HierR reward parts.

    ``judge``: the S3 judge; None (default) uses the rule judge over each task's
    facts. A judge must be deterministic for restore-then-step to be.
    """

    name: ClassVar[str] = "sgls"
    task_group_key: ClassVar[str | None] = "kind"
    # ``policy init``: episodes of ~305 tokens on average (at most ~830; the tool-schema
    # block is one token), actions of at most ~42 tokens (a reply with ids and amounts).
    # Detours (a harmless read-only or malformed call) as noise, the loss on the expert's
    # own actions only, as for workflow. Success needs every id, price and count copied
    # exactly from a tool response ~100-300 tokens back. From random weights 3,000 steps
    # left the copied characters at chance (loss 0.644, 0/200 held-out); from the calc
    # policy, which already copies digits from its context, the same steps reached 95.5%
    # teacher-forced accuracy on those characters and 17% held-out success (price_check
    # 82%, the kinds that compare prices 0-12%), rising. ~20 min for the 6,000 steps on
    # one quiet core, hence the 40-minute budget.
    tiny_sft: ClassVar[dict[str, Any]] = {
        "init_from": "calc", "train_tasks": 12_000, "p_error": 0.15,
        "train_on_mistakes": False, "max_steps": 6000, "eval_every": 500, "eval_tasks": 100,
        "test_tasks": 200, "max_new_tokens": 64, "stop_band": (0.3, 0.7), "noise": "detour",
        "minutes": 40.0}

    @classmethod
    def tiny_phrases(cls) -> tuple[str, ...]:
        """Each world's tool-schema block and protocol (everything of the prompt after the
        question), each tool's call prefix, the JSON keys (``"key": "`` for strings,
        ``"key": `` otherwise, also after ``, ``, ``{`` and ``[{``), and the fixed text of
        questions and replies (``train.envs.sgls_phrases``)."""
        phrases: list[str] = [render_prompt(world, "") for world in WORLDS.values()]
        for world in WORLDS.values():
            for tool in world.tools.values():
                prefix = f'<tool_call>{{"name": "{tool.name}", "arguments": {{'
                phrases.append(prefix + "}}</tool_call>" if not tool.parameters["properties"]
                               else prefix)
        keys = [*(f'"{k}": "' for k in SGLS_STRING_KEYS),
                *(f'"{k}": ' for k in SGLS_OTHER_KEYS)]
        for key in keys:
            phrases += [key, ", " + key, "{" + key, "[{" + key]
        phrases += ["}}</tool_call>", "<tool_response>{", "}</tool_response>",
                    "}]}</tool_response>", "}, {", ".0, ", ".0}", *SGLS_TEXT_TOKENS]
        return tuple(dict.fromkeys(phrases))

    def __init__(self, judge: Judge | None = None, system_prompt_chars: int = 0) -> None:
        self.judge = judge
        # a long shared system prompt ahead of the task (train.envs.preamble; 0 = none):
        # every world's tool schemas, so trees of all worlds share it
        self._preamble = system_preamble(
            self.name, [t.schema() for w in WORLDS.values() for t in w.tools.values()],
            system_prompt_chars)
        self._s: dict[str, Any] | None = None
        self._task: Task | None = None

    # ------------------------------------------------------------------ protocol

    def reset(self, task: Task) -> str:
        cfg = task.config
        missing = {"world", "question", "state", "gold", "gold_effects", "facts"} - set(cfg)
        if task.env != self.name or missing or cfg["world"] not in WORLDS:
            raise ValueError(f"task {task.task_id!r} is not an sgls task "
                             f"(env={task.env!r}, missing config keys {sorted(missing)})")
        self._task = task
        self._s = json.loads(canonical_json({
            "v": SNAPSHOT_VERSION,
            "task": {"task_id": task.task_id, "world": cfg["world"],
                     "question": cfg["question"], "gold": cfg["gold"],
                     "gold_effects": cfg["gold_effects"], "facts": cfg["facts"],
                     "answer": task.answer or "", "max_steps": task.max_steps},
            "world": cfg["state"],
            "effects": [],
            "steps": 0,
            "done": False,
            "final": None,
            "hist": {"n_open": 0, "n_close": 0, "n_valid": 0, "pred": [], "responses": []},
        }))
        return self._preamble + render_prompt(WORLDS[cfg["world"]], cfg["question"])

    def step(self, action_text: str) -> StepResult:
        s = self._state()
        if s["done"]:
            return StepResult(error_response("the episode is over; call reset"), True,
                              dict(s["final"]))
        s["steps"] += 1
        if len(action_text) > MAX_ACTION_CHARS:
            observation = error_response(f"action is longer than {MAX_ACTION_CHARS} characters")
            return self._after_turn(observation)
        text = strip_think(action_text)
        block = first_block(text)
        if block is None:
            self._record(text)
            return self._after_turn(error_response(
                "expected a tool_call block holding a JSON object, or an answer block"))
        if block[0] == "answer":
            self._record(text)
            return self._finish(block[1].strip())
        return self._after_turn(self._run_calls(text))

    def snapshot(self) -> bytes:
        return canonical_json(self._state()).encode("ascii")

    def restore(self, state: bytes) -> None:
        loaded = json.loads(state)
        if not isinstance(loaded, dict) or loaded.get("v") != SNAPSHOT_VERSION:
            raise ValueError(f"not an sgls snapshot of version {SNAPSHOT_VERSION}")
        if self._task is not None and self._task.task_id != loaded["task"]["task_id"]:
            self._task = None
        self._s = loaded

    def expert_action(self) -> str:
        """The next gold step not yet written (all its calls as parallel blocks), then
        the reference answer. Progress is matched against the calls written so far,
        so a stray read-only call does not derail the expert."""
        s = self._state()
        written = Counter(Call.from_json(c).canonical() for turn in s["hist"]["pred"]
                          for c in turn)
        for step in s["task"]["gold"]:
            need = Counter(Call.from_json(c).canonical() for c in step)
            if need - written:
                return "\n".join(
                    f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['arguments']})}"
                    "</tool_call>" for c in step)
            written -= need
        return f"<answer>{s['task']['answer']}</answer>"

    @classmethod
    def generate_tasks(cls, n: int, seed: int, worlds: Sequence[str] = ("shop", "flight"),
                       kinds: Sequence[str] | None = None, **mix: Any) -> list[Task]:
        """``n`` tasks; task i uses world ``worlds[i % len(worlds)]`` and a kind drawn
        from that world's kinds (``kinds`` restricts them; see ``TASK_KINDS``).

        Each task has its own generator seeded by ``(seed, i)``, so a task does
        not depend on ``n``. ``max_steps`` = gold tool turns + 1 + :data:`STEP_SLACK`.
        """
        if mix:
            raise TypeError(f"unknown options {sorted(mix)}; sgls takes worlds= and kinds=")
        unknown = [w for w in worlds if w not in TASK_KINDS]
        if unknown or not worlds:
            raise ValueError(f"unknown worlds {unknown}; choose from {sorted(TASK_KINDS)}")
        tasks = []
        for i in range(n):
            world = worlds[i % len(worlds)]
            names = [k for k in TASK_KINDS[world] if kinds is None or k in kinds]
            if not names:
                raise ValueError(f"no kind of {kinds} in world {world!r}; "
                                 f"it has {sorted(TASK_KINDS[world])}")
            rng = random.Random(f"sgls:{seed}:{i}")
            spec = TASK_KINDS[world][rng.choice(names)](rng)
            config = {"world": spec.world, "kind": spec.kind, "question": spec.question,
                      "state": spec.state, "gold": spec.gold, "gold_effects": spec.effects,
                      "facts": spec.facts}
            tasks.append(Task(
                task_id=f"sgls-{seed}-{i}-{world}-{spec.kind}", env=cls.name,
                prompt=render_prompt(WORLDS[world], spec.question), answer=spec.answer,
                max_steps=len(spec.gold) + 1 + STEP_SLACK, config=config))
        return tasks

    # ------------------------------------------------------------------ recoverability

    def is_recoverable(self, state: bytes | None = None) -> bool:
        """Whether some continuation of ``state`` (a snapshot; default: the current
        state) can still reach ``success`` (see the module docstring)."""
        s = self._state() if state is None else json.loads(state)
        if s["done"]:
            return bool(s["final"] and s["final"]["success"] == 1.0)
        owed = _effect_counts(s["task"]["gold_effects"])
        done = _effect_counts(s["effects"])
        if done - owed:
            return False
        evidence = grounding_text(s["hist"]["responses"])
        grounded = all(mentions(evidence, f) for f in s["task"]["facts"])
        turns_needed = (0 if owed == done and grounded else 1) + 1
        return s["task"]["max_steps"] - s["steps"] >= turns_needed

    def first_irrecoverable_step(self, actions: Sequence[str],
                                 task: Task | None = None) -> int | None:
        """The 1-based step after which ``actions``, played from the start of ``task``
        (default: the last task given to ``reset``), first leave no way to
        ``success``; 0 if the start already does, None if it never happens.

        Plays on a scratch environment; this one is untouched.
        """
        task = task or self._task
        if task is None:
            raise ValueError("no task: reset this environment or pass task=")
        env = SglsEnv(judge=self.judge)
        env.reset(task)
        if not env.is_recoverable():
            return 0
        for k, action in enumerate(actions, start=1):
            if env._state()["done"]:
                break
            env.step(action)
            if not env.is_recoverable():
                return k
        return None

    # ------------------------------------------------------------------ internals

    def _state(self) -> dict[str, Any]:
        if self._s is None:
            raise RuntimeError("call reset (or restore) before using the environment")
        return self._s

    def _world(self) -> World:
        return WORLDS[self._state()["task"]["world"]]

    def _record(self, text: str) -> list[Any]:
        """Add one action's tags, valid blocks and calls to the HierR history; returns
        the blocks (think blocks already stripped from ``text``)."""
        hist = self._state()["hist"]
        scan = scan_action(text, self._world().tools)
        hist["n_open"] += scan.n_open
        hist["n_close"] += scan.n_close
        hist["n_valid"] += scan.n_valid
        if scan.calls:
            hist["pred"].append([c.to_json() for c in scan.calls])
        return list(scan.blocks)

    def _run_calls(self, text: str) -> str:
        """Run every call of a tool turn; each answer (result or error) is a tool
        response, for the observation and for the S3 judge alike."""
        s = self._state()
        world = self._world()
        contents: list[str] = []
        budget = MAX_CALLS_PER_TURN
        for block in self._record(text):
            if block.error is not None:
                contents.append(f"error: {block.error}")
                continue
            for c in block.calls:
                if budget == 0:
                    contents.append(f"error: more than {MAX_CALLS_PER_TURN} calls in one turn; "
                                    "this call did not run")
                    continue
                budget -= 1
                try:
                    response, effect = world.call(s["world"], c.name, c.arguments)
                except ToolError as exc:
                    contents.append(f"error: {ascii_clip(str(exc), 300)}")
                    continue
                contents.append(json.dumps(response))
                if effect is not None:
                    s["effects"].append(effect)
        s["hist"]["responses"].extend(contents)
        return "\n".join(tool_response(c) for c in contents)

    def _after_turn(self, observation: str) -> StepResult:
        s = self._state()
        if s["steps"] >= s["task"]["max_steps"]:
            parts = self._score(None).parts()
            parts.update(reward=0.0, success=0.0, truncated=1.0)
            s["done"], s["final"] = True, parts
            return StepResult(observation, True, dict(parts))
        return StepResult(observation, False, {"reward": 0.0})

    def _finish(self, reply: str) -> StepResult:
        s = self._state()
        score = self._score(reply)
        parts = score.parts()
        parts.update(success=float(self._success(reply)), truncated=0.0)
        s["done"], s["final"] = True, parts
        return StepResult("", True, dict(parts))

    def _score(self, reply: str | None) -> HierR:
        s = self._state()
        t, hist = s["task"], s["hist"]
        judge = self.judge or RuleJudge(tuple(t["facts"]))
        return hierr([[Call.from_json(c) for c in turn] for turn in hist["pred"]],
                     [[Call.from_json(c) for c in step] for step in t["gold"]],
                     n_open=hist["n_open"], n_close=hist["n_close"], n_valid=hist["n_valid"],
                     question=t["question"], tool_responses=hist["responses"], reply=reply,
                     judge=judge)

    def _success(self, reply: str) -> bool:
        s = self._state()
        if _effect_counts(s["effects"]) != _effect_counts(s["task"]["gold_effects"]):
            return False
        return RuleJudge(tuple(s["task"]["facts"])).rate(
            s["task"]["question"], s["hist"]["responses"], reply) == 5
