"""``sgls``: HierR parts by hand (S2-S4), expert episodes, recoverability ground truth,
snapshot/restore determinism (hypothesis) and hostile actions."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.envs import make_env
from train.envs.base import TOOL_CALL_RE, StepResult, Task, parse_action
from train.envs.sgls import MAX_ACTION_CHARS, MAX_CALLS_PER_TURN, SglsEnv
from train.envs.sgls_reward import (
    TOOL_CALL_TAGS,
    Call,
    RuleJudge,
    first_block,
    format_score,
    hierr,
    key_value_scores,
    loose_equal,
    mentions,
    name_f1,
    parallel_score,
    scan_action,
    strip_think,
    summary_reward,
    tag_spans,
    tool_reward,
)
from train.envs.sgls_worlds import TASK_KINDS, WORLDS

SHOP_TOOLS = WORLDS["shop"].tools


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def C(name: str, **arguments: Any) -> Call:
    return Call(name, arguments)


def play(env: SglsEnv, actions: Sequence[str]) -> list[StepResult]:
    return [env.step(a) for a in actions]


def expert_episode(env: SglsEnv, task: Task) -> list[str]:
    env.reset(task)
    actions = []
    while True:
        actions.append(env.expert_action())
        if env.step(actions[-1]).done:
            return actions


class FixedJudge:
    def __init__(self, rating: int | None) -> None:
        self.rating = rating

    def rate(self, question: str, tool_responses: Sequence[str], reply: str) -> int | None:
        return self.rating


# ------------------------------------------------------------------ block finding

_FRAGMENTS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>", "</think>",
              "<thinking>", "</thinking>", "<think", "ing>", "x", "<", "/", ">", "\n"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=14).map("".join))
def test_linear_block_finder_matches_the_lazy_regex(text: str) -> None:
    """The token walk finds what the reference's lazy regexes find (they are quadratic)."""
    think = re.compile(r"<think(?:ing)?>(.*?)</think(?:ing)?>", re.DOTALL)
    assert strip_think(text) == think.sub("", text)
    assert [text[s.inner] for s in tag_spans(text, TOOL_CALL_TAGS)] == TOOL_CALL_RE.findall(text)
    parsed = parse_action(text)
    found = first_block(text)
    if found is None:
        assert parsed.kind == "malformed" and (parsed.error or "").startswith("expected")
    elif found[0] == "answer":
        assert parsed.kind == "answer" and parsed.answer == found[1].strip()
    else:
        match = TOOL_CALL_RE.search(text)
        assert parsed.kind != "answer" and match is not None and match.group(1) == found[1]


# ------------------------------------------------------------------ HierR by hand (S2)


def test_fmt_counts_valid_blocks_over_max_tags_and_ignores_think() -> None:
    text = ("<think><tool_call>{\"name\": \"view_cart\"}</tool_call></think>"
            + call("get_item", item_id="A")  # valid
            + "<tool_call>{not json}</tool_call>"  # invalid JSON
            + "<tool_call>{\"name\": \"fly\", \"arguments\": {}}</tool_call>"  # unknown tool
            + "<tool_call>")  # unclosed
    scan = scan_action(text, SHOP_TOOLS)
    assert (scan.n_open, scan.n_close, scan.n_valid) == (4, 3, 1)
    assert format_score(scan.n_valid, scan.n_open, scan.n_close) == pytest.approx(1 / 4)
    assert scan.calls == [C("get_item", item_id="A")]
    assert format_score(0, 0, 0) == 0.0
    # A JSON list is one block holding several calls; an empty list is invalid.
    scan = scan_action('<tool_call>[{"name": "view_cart"}, {"name": "view_cart"}]</tool_call>'
                       "<tool_call>[]</tool_call>", SHOP_TOOLS)
    assert scan.n_valid == 1 and len(scan.calls) == 2


def test_name_is_multiset_f1() -> None:
    # overlap: a once (pred has 2, gold 1), b once -> 2*2/(3+3)
    assert name_f1(["a", "a", "b"], ["a", "b", "c"]) == pytest.approx(2 / 3)
    assert name_f1([], []) == 1.0
    assert name_f1(["a"], []) == 0.0


def test_key_and_value_by_greedy_matching() -> None:
    gold = [C("get_item", item_id="SKU-1"), C("add_to_cart", item_id="SKU-1", quantity=2)]
    pred = [C("add_to_cart", item_id=" sku-1 ", quantity="2", extra=True),
            C("get_item", item_id="SKU-9")]
    # get_item: keys equal (1), value wrong (0). add_to_cart: keys Jaccard 2/3, both
    # values loosely equal (trimmed/lower-cased string, "2" == 2) -> 2/2.
    key, value = key_value_scores(pred, gold)
    assert key == pytest.approx((1 + 2 / 3) / 2)
    assert value == pytest.approx((0 + 1) / 2)
    # Greedy, not optimal: the first gold call takes the only candidate.
    key, value = key_value_scores([C("get_item", item_id="B")],
                                  [C("get_item", item_id="A"), C("get_item", item_id="B")])
    assert (key, value) == (0.5, 0.0)
    # No gold call has arguments: both terms are 1; none predicted: both 0.
    assert key_value_scores([], [C("view_cart")]) == (1.0, 1.0)
    assert key_value_scores([], gold) == (0.0, 0.0)


def test_loose_equal() -> None:
    assert loose_equal("True", True) and loose_equal("10", 10.0) and loose_equal(" Ab", "aB")
    assert loose_equal("1", True) and loose_equal(None, None)
    assert not loose_equal(None, "None") and not loose_equal("0", True)
    assert loose_equal({"a": 1, "b": [2]}, {"b": [2], "a": 1})
    assert not loose_equal([1], "[1]")


def test_par_compares_first_turn_with_first_gold_step() -> None:
    a, b, c = C("get_item", item_id="A"), C("get_item", item_id="B"), C("view_cart")
    assert parallel_score([[a, b], [c]], [[a, c], [b]]) == 1.0
    assert parallel_score([[a], [b, c]], [[a, b], [c]]) == 0.0
    assert parallel_score([], []) == 1.0


def test_r_tool_weights() -> None:
    assert tool_reward(1, 0, 0, 0, 0) == pytest.approx(0.10)
    assert tool_reward(0, 1, 0, 0, 0) == pytest.approx(0.25)
    assert tool_reward(0, 0, 1, 0, 0) == pytest.approx(0.15)
    assert tool_reward(0, 0, 0, 1, 0) == pytest.approx(0.20)
    assert tool_reward(0, 0, 0, 0, 1) == pytest.approx(0.30)
    assert tool_reward(1, 1, 1, 1, 1) == 1.0


def test_hierr_by_hand() -> None:
    gold = [[C("get_item", item_id="A"), C("get_item", item_id="B")],
            [C("add_to_cart", item_id="A", quantity=1)]]
    pred = [[C("get_item", item_id="A")], [C("add_to_cart", item_id="A", quantity=3)]]
    h = hierr(pred, gold, n_open=3, n_close=3, n_valid=2, question="q",
              tool_responses=["{}"], reply="a reply of some length", judge=FixedJudge(4))
    fmt, name = 2 / 3, 2 * 2 / (2 + 3)
    key, value = (1 + 1 + 0) / 3, (1 + 0.5 + 0) / 3  # the second get_item is unmatched
    assert (h.fmt, h.name, h.key, h.value, h.par) == pytest.approx((fmt, name, key, value, 0))
    r_tool = 0.10 * fmt + 0.25 * name + 0.15 * key + 0.20 * value
    assert h.r_tool == pytest.approx(r_tool)
    assert h.r_sum == 0.75  # (4 - 1) / 4
    assert h.reward == pytest.approx((r_tool + 0.75) / 2)
    assert set(h.parts()) == {"reward", "fmt", "name", "key", "value", "par", "r_tool",
                              "r_sum"}


# ------------------------------------------------------------------ S3 and S4


def test_s3_zero_rules() -> None:
    judge = FixedJudge(5)
    assert summary_reward("q", ["{}"], "long enough reply", judge) == 1.0
    assert summary_reward("q", [], "long enough reply", judge) == 0.0  # no tool response
    assert summary_reward("q", ["{}"], "  too short ", judge) == 0.0  # under 10 characters
    assert summary_reward("q", ["{}"], None, judge) == 0.0  # no reply at all
    assert summary_reward("q", ["{}"], "long enough reply", FixedJudge(None)) == 0.0
    assert summary_reward("q", ["{}"], "long enough reply", FixedJudge(7)) == 0.0
    assert summary_reward("q", ["{}"], "long enough reply", FixedJudge(2)) == 0.25


def test_s4_omission_guard() -> None:
    gold = [[C("view_cart")]]
    h = hierr([], gold, n_open=0, n_close=0, n_valid=0, question="q", tool_responses=[],
              reply="a long enough reply", judge=FixedJudge(5))
    assert h.omitted and (h.fmt, h.name, h.key, h.value, h.par, h.r_tool) == (0,) * 6
    assert h.r_sum == -0.5 and h.reward == -0.25
    # A written but broken tag is not an omission: the normal terms apply.
    h = hierr([], gold, n_open=1, n_close=0, n_valid=0, question="q", tool_responses=[],
              reply="a long enough reply", judge=FixedJudge(5))
    assert not h.omitted and h.r_sum == 0.0 and h.r_tool == pytest.approx(0.15 + 0.20)
    # No gold calls, none written: no guard.
    assert not hierr([], [], n_open=0, n_close=0, n_valid=0, question="q", tool_responses=[],
                     reply=None, judge=FixedJudge(5)).omitted


def test_rule_judge_needs_grounded_facts() -> None:
    judge = RuleJudge(("ORD-1A2B3C", "1045.90"))
    responses = ['{"order_id": "ORD-1A2B3C", "total": 1045.9}']
    assert judge.rate("q", responses, "Order ord-1a2b3c, total $1,045.90.") == 5
    assert judge.rate("q", responses, "Order ORD-1A2B3C placed.") == 3  # 1 + 4*1//2
    assert judge.rate("q", ['{"total": 1045.9}'], "ORD-1A2B3C for 1045.90") == 3
    assert judge.rate("q", responses, "nothing useful here") == 1
    # An error that echoes the policy's guess grounds nothing.
    echo = ["error: no order with id 'ORD-1A2B3C'", '{"total": 1045.9}']
    assert judge.rate("q", echo, "ORD-1A2B3C for 1045.90") == 3
    assert not mentions("ORD-1A2B3CD", "ORD-1A2B3C")
    assert not mentions("flight FL123", "123") and mentions("costs 45.9.", "45.90")


def test_episode_s4_and_s3_through_the_env() -> None:
    env = SglsEnv()
    task = SglsEnv.generate_tasks(1, 3, worlds=("shop",), kinds=("price_check",))[0]
    env.reset(task)
    parts = env.step(f"<answer>{task.answer}</answer>").reward_parts  # no call at all
    assert parts["r_sum"] == -0.5 and parts["r_tool"] == 0.0 and parts["reward"] == -0.25
    env.reset(task)
    env.step(env.expert_action())
    parts = env.step("<answer>short</answer>").reward_parts
    assert parts["r_tool"] == 1.0 and parts["r_sum"] == 0.0 and parts["reward"] == 0.5
    assert parts["success"] == 0.0


# ------------------------------------------------------------------ expert and tasks


@pytest.mark.parametrize("world", sorted(TASK_KINDS))
def test_expert_gets_maximal_reward(world: str) -> None:
    env = make_env("sgls")
    assert isinstance(env, SglsEnv)
    tasks = SglsEnv.generate_tasks(40, seed=11, worlds=(world,))
    assert {t.config["kind"] for t in tasks} == set(TASK_KINDS[world])
    for task in tasks:
        assert env.reset(task) == task.prompt
        actions = expert_episode(env, task)
        assert len(actions) == len(task.config["gold"]) + 1 <= task.max_steps
        parts = env.step("<answer>again</answer>").reward_parts  # after the end: unchanged
        assert parts == {"reward": 1.0, "fmt": 1.0, "name": 1.0, "key": 1.0, "value": 1.0,
                         "par": 1.0, "r_tool": 1.0, "r_sum": 1.0, "success": 1.0,
                         "truncated": 0.0}, task.task_id
        assert env.first_irrecoverable_step(actions) is None


def test_generator_is_seeded_and_mixes_worlds() -> None:
    a = SglsEnv.generate_tasks(6, seed=5)
    assert a == SglsEnv.generate_tasks(6, seed=5)
    assert a[:3] == SglsEnv.generate_tasks(3, seed=5)
    assert a != SglsEnv.generate_tasks(6, seed=6)
    assert [t.config["world"] for t in a] == ["shop", "flight"] * 3
    assert any(len(t.config["gold"][0]) == 2 for t in SglsEnv.generate_tasks(20, seed=0))
    with pytest.raises(ValueError, match="unknown worlds"):
        SglsEnv.generate_tasks(1, 0, worlds=("moon",))
    with pytest.raises(TypeError):
        SglsEnv.generate_tasks(1, 0, flavour="x")


# ------------------------------------------------------------------ recoverability


def _task(world: str, kind: str, seed: int = 0) -> Task:
    return SglsEnv.generate_tasks(1, seed, worlds=(world,), kinds=(kind,))[0]


def test_wrong_order_is_irrecoverable() -> None:
    task = _task("shop", "buy_cheapest")
    gold = task.config["gold"]
    target = gold[1][0]["arguments"]["item_id"]
    qty = gold[1][0]["arguments"]["quantity"]
    others = [i for i, it in task.config["state"]["items"].items()
              if i != target and it["stock"] >= 1]
    env = SglsEnv()
    env.reset(task)
    actions = [call("search_items", **gold[0][0]["arguments"]),
               call("add_to_cart", item_id=others[0], quantity=1),  # wrong, but reversible
               call("remove_from_cart", item_id=others[0]),
               call("add_to_cart", item_id=others[0], quantity=1),
               call("place_order", shipping="express"),  # wrong cart: irreversible
               env.expert_action()]
    results = []
    for k, action in enumerate(actions, start=1):
        results.append(env.step(action))
        assert env.is_recoverable() == (k < 5), k
    assert "error" not in results[4].observation
    assert env.first_irrecoverable_step(actions) == 5
    assert SglsEnv().first_irrecoverable_step(actions, task=task) == 5
    # Ground truth agrees with the outcome: the expert cannot finish it any more.
    while not (r := env.step(env.expert_action())).done:
        pass
    assert r.reward_parts["success"] == 0.0
    # Skipping the search and filling the right cart directly stays recoverable.
    env.reset(task)
    env.step(call("add_to_cart", item_id=target, quantity=qty))
    assert env.is_recoverable()


def test_unrequested_payment_and_wrong_booking_are_irrecoverable() -> None:
    env = SglsEnv()
    task = _task("shop", "compare_buy")
    env.reset(task)
    for _ in range(3):  # compare, add to cart, place the order
        placed = env.step(env.expert_action())
    order_id = json.loads(placed.observation.removeprefix("<tool_response>")
                          .removesuffix("</tool_response>"))["order_id"]
    assert env.is_recoverable()
    env.step(call("pay_order", order_id=order_id, method="card"))  # not asked for
    assert not env.is_recoverable()

    task = _task("flight", "book_cheapest", seed=2)
    gold = task.config["gold"]
    booked = gold[1][0]["arguments"]
    wrong = next(i for i, f in task.config["state"]["flights"].items()
                 if i != booked["flight_id"] and f["seats"][booked["cabin"]] > 0)
    actions = [call("search_flights", **gold[0][0]["arguments"]),
               call("book_flight", **{**booked, "flight_id": wrong})]
    env.reset(task)
    assert env.first_irrecoverable_step(actions) == 2
    # A refused irreversible call (unknown flight) changes nothing.
    assert env.first_irrecoverable_step(
        [call("book_flight", **{**booked, "flight_id": "FL000"})]) is None


def test_wrong_answer_and_wasted_steps_are_irrecoverable() -> None:
    env = SglsEnv()
    task = _task("flight", "cancel", seed=4)
    env.reset(task)
    expert = expert_episode(env, task)
    assert env.first_irrecoverable_step([*expert[:-1], "<answer>all done, trust me</answer>"]) \
        == len(expert)
    # price_check needs a tool turn and an answer: wasting all but one step is too many.
    task = _task("shop", "price_check")
    env.reset(task)
    junk = ["hello"] * task.max_steps
    assert env.first_irrecoverable_step(junk) == task.max_steps - 1


# ------------------------------------------------------------------ step limit


def test_step_limit_ends_with_reward_zero_and_parts_so_far() -> None:
    env = SglsEnv()
    task = _task("shop", "buy_cheapest", seed=1)
    env.reset(task)
    results = [env.step(env.expert_action())]
    results += [env.step("thinking out loud") for _ in range(task.max_steps - 1)]
    assert [r.done for r in results] == [False] * (task.max_steps - 1) + [True]
    parts = results[-1].reward_parts
    assert parts["reward"] == 0.0 and parts["truncated"] == 1.0 and parts["success"] == 0.0
    assert parts["name"] == pytest.approx(2 * 1 / (1 + 4)) and parts["par"] == 1.0
    assert parts["r_tool"] > 0 and parts["r_sum"] == 0.0  # no reply
    assert all(r.reward_parts == {"reward": 0.0} for r in results[:-1])
    assert not env.is_recoverable()


# ------------------------------------------------------------------ snapshot / restore

TASKS = SglsEnv.generate_tasks(4, seed=21) + SglsEnv.generate_tasks(
    3, seed=22, worlds=("flight",), kinds=("rebook", "cancel"))
_HOSTILE = ["", "plain words", "<tool_call>", "<tool_call>{</tool_call>", "<answer></answer>",
            "<tool_call>[]</tool_call>", '<tool_call>{"name": 5}</tool_call>',
            "<think>" + call("view_cart") + "</think>", "</tool_call></tool_call>"]


def _values(task: Task) -> list[Any]:
    state = task.config["state"]
    values: list[Any] = [a for step in task.config["gold"] for c in step
                         for a in c["arguments"].values()]
    for table in ("items", "flights", "bookings"):
        values += sorted(state.get(table, {}))[:4]
    return [*values, "x", "", 0, -1, 2.5, None, True, ["a"]]


@st.composite
def actions(draw: st.DrawFn, task: Task) -> str:
    world = WORLDS[task.config["world"]]
    arg_names = sorted({k for t in world.tools.values() for k in t.parameters["properties"]})
    gold_calls = [c for step in task.config["gold"] for c in step]

    def random_call() -> str:
        if draw(st.booleans()):
            c = draw(st.sampled_from(gold_calls))
            return call(c["name"], **c["arguments"])
        name = draw(st.sampled_from([*world.tools, "nope"]))
        args = draw(st.dictionaries(st.sampled_from([*arg_names, "bogus"]),
                                    st.sampled_from(_values(task)) | st.integers(-2, 12)
                                    | st.text(max_size=4), max_size=3))
        return call(name, **args)

    kind = draw(st.sampled_from(["calls", "gold_step", "answer", "hostile", "text"]))
    if kind == "calls":
        return "".join(random_call() for _ in range(draw(st.integers(1, 3))))
    if kind == "gold_step":
        step = draw(st.sampled_from(task.config["gold"]))
        return "".join(call(c["name"], **c["arguments"]) for c in step)
    if kind == "answer":
        return "<answer>" + draw(st.sampled_from([task.answer or "", "no idea at all"])) + \
            "</answer>"
    if kind == "hostile":
        return draw(st.sampled_from(_HOSTILE))
    return draw(st.text(max_size=30))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_restore_then_step_is_deterministic(data: st.DataObject) -> None:
    task = data.draw(st.sampled_from(TASKS))
    prefix = data.draw(st.lists(actions(task), max_size=5))
    suffix = data.draw(st.lists(actions(task), min_size=1, max_size=5))
    env = SglsEnv()
    env.reset(task)
    recoverable = [env.is_recoverable()]
    for a in prefix:
        env.step(a)
        recoverable.append(env.is_recoverable())
    snap = env.snapshot()
    live = []
    for a in suffix:
        live.append(env.step(a))
        recoverable.append(env.is_recoverable(env.snapshot()))
    end = env.snapshot()
    # Recoverability is monotone along a trajectory (BEL's assumption, METHODS §2.1).
    assert recoverable == sorted(recoverable, reverse=True)

    fresh = SglsEnv()
    fresh.restore(snap)
    assert fresh.snapshot() == snap
    assert play(fresh, suffix) == live
    assert fresh.snapshot() == end
    env.restore(snap)  # the same instance, back in time
    assert play(env, suffix) == live and env.snapshot() == end


def test_suffix_recoverability_replayed() -> None:
    """is_recoverable(snapshot) equals is_recoverable() after restoring it."""
    env = SglsEnv()
    env.reset(TASKS[0])
    env.step(env.expert_action())
    snap = env.snapshot()
    other = SglsEnv()
    other.restore(snap)
    assert other.is_recoverable() == env.is_recoverable(snap)


# ------------------------------------------------------------------ hostile actions


def test_hostile_actions_never_raise() -> None:
    shop = _task("shop", "buy_cheapest")
    flight = _task("flight", "cancel")
    item = shop.config["gold"][1][0]["arguments"]["item_id"]
    cases: list[tuple[Task, str, str]] = [
        (shop, "", "expected a tool_call block"),
        (shop, "<tool_call>{\"name\": \"view_cart\"", "expected a tool_call block"),
        (shop, "<tool_call>{bad json}</tool_call>", "not valid JSON"),
        (shop, "<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
        (shop, "<tool_call>" * 5_900, "expected a tool_call block"),  # was quadratic with a regex
        (shop, "<think>" * 9_000 + call("view_cart"), '{"cart"'),
        (shop, "<tool_call>" + "[" * 5_000 + "]" * 5_000 + "</tool_call>", "nested too deeply"),
        (shop, '<tool_call>{"name": "x", "arguments": {"a": NaN}}</tool_call>', "not valid JSON"),
        (shop, '<tool_call>{"name": "get_item", "arguments": {"item_id": 1e400}}</tool_call>',
         "not valid JSON"),
        (shop, '<tool_call>{"name": "get_item", "arguments": {"item_id": ' + "9" * 5000
         + "}}</tool_call>", "not valid JSON"),
        (shop, call("teleport", to="moon"), "unknown tool 'teleport'"),
        (shop, '<tool_call>{"name": "get_item", "arguments": ["A"]}</tool_call>',
         '"arguments" must be a JSON object'),
        (shop, call("add_to_cart", item_id=item, quantity="two"),
         "argument 'quantity' must be of type integer"),
        (shop, call("add_to_cart", item_id=item, quantity=True), "of type integer"),
        (shop, call("add_to_cart", item_id=item), "missing required argument 'quantity'"),
        (shop, call("view_cart", sneaky=1), "unknown argument 'sneaky'"),
        (shop, call("place_order", shipping="teleport"), "must be one of"),
        (shop, call("add_to_cart", item_id=item, quantity=10**30), "in stock"),
        (shop, call("place_order", shipping="standard"), "the cart is empty"),
        (shop, call("get_item", item_id="A" * 60_000), "no item with id"),
        (shop, call("search_items", category="mugs", max_price=1e308), '{"items"'),
        (shop, call("view_cart", **{"\ud800": 1}), "unknown argument"),
        (shop, call("view_cart") * (MAX_CALLS_PER_TURN + 2), "did not run"),
        (flight, call("list_bookings", passenger="x" * 1000), "at most 64 characters"),
        (flight, call("book_flight", flight_id="FL1", passenger="\ud800\x00", cabin="economy"),
         "no flight with id"),
        (flight, call("search_flights", origin="SFO", destination="JFK", date="tomorrow"),
         "must look like"),
        (flight, "<answer><tool_call>x</tool_call> sure</answer>", ""),
    ]
    for task, action, expected in cases:
        outs = []
        for _ in range(2):
            env = SglsEnv()
            env.reset(task)
            result = env.step(action)
            snap = env.snapshot()
            snap.decode("ascii")
            result.observation.encode("utf-8")
            outs.append((result, snap))
        assert outs[0] == outs[1], action[:80]
        assert expected in outs[0][0].observation, (action[:80], outs[0][0].observation[:300])
    assert len(call("get_item", item_id="A" * 60_000)) < MAX_ACTION_CHARS


def test_refused_call_changes_nothing() -> None:
    task = _task("shop", "buy_cheapest")
    env = SglsEnv()
    env.reset(task)
    before = json.loads(env.snapshot())["world"]
    env.step(call("add_to_cart", item_id="SKU-0000", quantity=1)
             + call("pay_order", order_id="ORD-NOPE", method="card"))
    assert json.loads(env.snapshot())["world"] == before
    with pytest.raises(RuntimeError):
        SglsEnv().step("x")
    with pytest.raises(ValueError):
        env.reset(Task("t", "calc", "p"))
