"""The two SGLS tool worlds (a shop and flight booking) and their task generators.

A world is a set of tools, each a JSON schema plus a deterministic handler over
a JSON-able state dict. :meth:`World.call` checks the arguments against the
schema (``check_arguments``), then runs the handler, which either raises
:class:`ToolError` *before* changing anything or changes the state and returns
``(response, effect)``. ``effect`` is set only by the irreversible tools: it is
what the task's success is judged on (see ``train.envs.sgls``).

Money is held as integer cents and shown as a JSON number of dollars
(``4598`` cents shows as ``45.98``). Handlers never depend on dict order
(snapshots sort keys), and ids of orders and bookings are content hashes, so a
wrong order gets a different id than the gold one.

Task generators return a :class:`TaskSpec`: question, initial state, gold calls
(grouped by step, derived by running them on a copy of the state), the
irreversible effects the gold calls cause, the facts a correct reply states, and
a reference reply that states them.
"""

from __future__ import annotations

import copy
import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from train.envs.base import check_arguments
from train.envs.sgls_reward import ascii_clip, canonical_json, safe_text

JSON = dict[str, Any]
Handler = Callable[[JSON, JSON], tuple[JSON, JSON | None]]


class ToolError(Exception):
    """A call the world refuses (bad id, no stock, ...); the state is unchanged."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: JSON  # a JSON schema of an object
    handler: Handler
    irreversible: bool = False

    def schema(self) -> JSON:
        """The schema shown to the policy (OpenAI/Hermes function format)."""
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}


@dataclass(frozen=True)
class World:
    name: str
    tools: Mapping[str, Tool]

    def call(self, state: JSON, name: str, arguments: JSON) -> tuple[JSON, JSON | None]:
        """Run one call on ``state`` (mutated in place); raises ToolError, never else."""
        tool = self.tools.get(name)
        if tool is None:
            raise ToolError(f"unknown tool {safe_text(name)}")
        problem = check_arguments(arguments, tool.parameters)
        if problem is not None:
            raise ToolError(f"{name}: {ascii_clip(problem)}")
        return tool.handler(state, arguments)


def _obj(properties: JSON, required: list[str]) -> JSON:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _money(cents: int) -> float:
    return cents / 100


def _fmt_money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def _short_hash(*parts: Any) -> str:
    return hashlib.sha256(canonical_json(list(parts)).encode()).hexdigest()[:6].upper()


def _person(name: str) -> str:
    """A passenger name compared loosely: whitespace collapsed, case folded."""
    return " ".join(name.split()).casefold()


def _text_arg(args: JSON, key: str, limit: int = 64) -> str:
    value: str = args[key]
    if not value.strip() or len(value) > limit:
        raise ToolError(f"argument {key!r} must be a non-empty string of at most {limit} "
                        "characters")
    return value


# =========================================================================== shop

CATEGORIES = ("headphones", "keyboards", "mugs", "backpacks", "lamps", "notebooks")
SHIPPING_CENTS = {"standard": 0, "express": 999}
PAY_METHODS = ("card", "wallet")
_ADJECTIVES = ("Aurora", "Basalt", "Cobalt", "Drift", "Ember", "Fjord", "Granite", "Harbor",
               "Ion", "Juniper", "Kestrel", "Lumen")
_SINGULAR = {"headphones": "headphones", "keyboards": "keyboard", "mugs": "mug",
             "backpacks": "backpack", "lamps": "lamp", "notebooks": "notebook"}


def _item_view(item_id: str, item: JSON) -> JSON:
    return {"item_id": item_id, "name": item["name"], "category": item["category"],
            "price": _money(item["price"]), "stock": item["stock"]}


def _cart_view(state: JSON) -> JSON:
    lines = [{"item_id": i, "name": state["items"][i]["name"], "quantity": q,
              "unit_price": _money(state["items"][i]["price"])}
             for i, q in sorted(state["cart"].items())]
    subtotal = sum(state["items"][i]["price"] * q for i, q in state["cart"].items())
    return {"cart": lines, "subtotal": _money(subtotal)}


def _order_view(order_id: str, order: JSON) -> JSON:
    return {"order_id": order_id,
            "items": [{"item_id": i, "quantity": q, "unit_price": _money(p)}
                      for i, q, p in order["items"]],
            "shipping": order["shipping"], "total": _money(order["total"]),
            "status": order["status"], "paid_with": order["paid_with"]}


def _get_item_record(state: JSON, item_id: str) -> JSON:
    item: JSON | None = state["items"].get(item_id)
    if item is None:
        raise ToolError(f"no item with id {safe_text(item_id)}")
    return item


def shop_search_items(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    query = args.get("query", "").strip().casefold()
    found = [_item_view(i, it) for i, it in sorted(state["items"].items())
             if it["category"] == args["category"] and query in it["name"].casefold()
             and ("max_price" not in args or _money(it["price"]) <= args["max_price"])]
    found.sort(key=lambda v: (v["price"], v["item_id"]))
    return {"items": found}, None


def shop_get_item(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    return _item_view(args["item_id"], _get_item_record(state, args["item_id"])), None


def shop_add_to_cart(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    item = _get_item_record(state, args["item_id"])
    qty = args["quantity"]
    in_cart = state["cart"].get(args["item_id"], 0)
    if qty < 1:
        raise ToolError("quantity must be at least 1")
    if in_cart + qty > item["stock"]:
        raise ToolError(f"only {item['stock']} in stock ({in_cart} already in the cart)")
    state["cart"][args["item_id"]] = in_cart + qty
    return _cart_view(state), None


def shop_remove_from_cart(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    if args["item_id"] not in state["cart"]:
        raise ToolError(f"item {safe_text(args['item_id'])} is not in the cart")
    del state["cart"][args["item_id"]]
    return _cart_view(state), None


def shop_view_cart(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    return _cart_view(state), None


def shop_place_order(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    if not state["cart"]:
        raise ToolError("the cart is empty")
    for item_id, qty in sorted(state["cart"].items()):
        if qty > state["items"][item_id]["stock"]:
            raise ToolError(f"only {state['items'][item_id]['stock']} of {item_id} in stock")
    lines = [[i, q, state["items"][i]["price"]] for i, q in sorted(state["cart"].items())]
    total = sum(q * p for _, q, p in lines) + SHIPPING_CENTS[args["shipping"]]
    content = [[i, q] for i, q, _ in lines]
    order_id = "ORD-" + _short_hash("order", content, args["shipping"], len(state["orders"]))
    for item_id, qty, _ in lines:
        state["items"][item_id]["stock"] -= qty
    state["cart"] = {}
    state["orders"][order_id] = {"items": lines, "shipping": args["shipping"], "total": total,
                                 "status": "placed", "paid_with": None}
    effect = {"op": "place_order", "items": content, "shipping": args["shipping"]}
    return _order_view(order_id, state["orders"][order_id]), effect


def shop_pay_order(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    order = state["orders"].get(args["order_id"])
    if order is None:
        raise ToolError(f"no order with id {safe_text(args['order_id'])}")
    if order["status"] != "placed":
        raise ToolError(f"order {args['order_id']} is already {order['status']}")
    order["status"], order["paid_with"] = "paid", args["method"]
    effect = {"op": "pay_order", "order_id": args["order_id"], "method": args["method"]}
    return {"order_id": args["order_id"], "status": "paid", "amount": _money(order["total"]),
            "method": args["method"]}, effect


def shop_get_order(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    order = state["orders"].get(args["order_id"])
    if order is None:
        raise ToolError(f"no order with id {safe_text(args['order_id'])}")
    return _order_view(args["order_id"], order), None


_STR = {"type": "string"}
SHOP = World("shop", {t.name: t for t in (
    Tool("search_items", "List the shop's items in a category, cheapest first; optionally "
         "filter by a name substring and a maximum price in dollars.",
         _obj({"category": {"type": "string", "enum": list(CATEGORIES)},
               "query": _STR, "max_price": {"type": "number"}}, ["category"]),
         shop_search_items),
    Tool("get_item", "Show one item: name, category, price and units in stock.",
         _obj({"item_id": _STR}, ["item_id"]), shop_get_item),
    Tool("add_to_cart", "Add units of an item to the cart (up to its stock).",
         _obj({"item_id": _STR, "quantity": {"type": "integer"}}, ["item_id", "quantity"]),
         shop_add_to_cart),
    Tool("remove_from_cart", "Remove an item (all its units) from the cart.",
         _obj({"item_id": _STR}, ["item_id"]), shop_remove_from_cart),
    Tool("view_cart", "Show the cart and its subtotal.", _obj({}, []), shop_view_cart),
    Tool("place_order", "Place an order for everything in the cart and empty it. "
         "Irreversible. Express shipping costs 9.99.",
         _obj({"shipping": {"type": "string", "enum": list(SHIPPING_CENTS)}}, ["shipping"]),
         shop_place_order, irreversible=True),
    Tool("pay_order", "Pay a placed order. Irreversible.",
         _obj({"order_id": _STR, "method": {"type": "string", "enum": list(PAY_METHODS)}},
              ["order_id", "method"]),
         shop_pay_order, irreversible=True),
    Tool("get_order", "Show an order: items, shipping, total and status.",
         _obj({"order_id": _STR}, ["order_id"]), shop_get_order),
)})


# =========================================================================== flights

AIRPORTS = ("ATL", "BOS", "DEN", "JFK", "LAX", "ORD", "SEA", "SFO")
CABINS = ("economy", "business")
_PASSENGERS = ("Ada Park", "Ben Ortiz", "Chen Wei", "Dana Scott", "Eli Novak", "Fay Moreau",
               "Gus Lind", "Hana Sato", "Ivo Petrov", "Jun Kim")
_DATE_RE_LEN = 10


def _valid_date(text: str) -> bool:
    parts = text.split("-")
    return (len(text) == _DATE_RE_LEN and len(parts) == 3 and all(p.isdigit() for p in parts)
            and [len(p) for p in parts] == [4, 2, 2] and text.isascii())


def _flight_view(flight_id: str, f: JSON) -> JSON:
    return {"flight_id": flight_id, "origin": f["origin"], "destination": f["destination"],
            "date": f["date"], "depart": f["depart"],
            "price_economy": _money(f["price"]["economy"]),
            "price_business": _money(f["price"]["business"]),
            "seats_economy": f["seats"]["economy"], "seats_business": f["seats"]["business"]}


def _booking_view(booking_id: str, b: JSON) -> JSON:
    return {"booking_id": booking_id, "flight_id": b["flight_id"], "passenger": b["passenger"],
            "cabin": b["cabin"], "price": _money(b["price"]), "status": b["status"],
            "refund": _money(b["refund"]) if b["refund"] is not None else None}


def refund_cents(cabin: str, price: int) -> int:
    """Economy refunds 80% (rounded down to the cent), business 100%."""
    return price * 4 // 5 if cabin == "economy" else price


def flight_search_flights(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    if not _valid_date(args["date"]):
        raise ToolError("argument 'date' must look like 2025-03-14")
    found = [_flight_view(i, f) for i, f in sorted(state["flights"].items())
             if (f["origin"], f["destination"], f["date"])
             == (args["origin"], args["destination"], args["date"])]
    found.sort(key=lambda v: (v["depart"], v["flight_id"]))
    return {"flights": found}, None


def flight_get_flight(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    f = state["flights"].get(args["flight_id"])
    if f is None:
        raise ToolError(f"no flight with id {safe_text(args['flight_id'])}")
    return _flight_view(args["flight_id"], f), None


def flight_book_flight(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    f = state["flights"].get(args["flight_id"])
    if f is None:
        raise ToolError(f"no flight with id {safe_text(args['flight_id'])}")
    passenger = " ".join(_text_arg(args, "passenger").split())
    cabin = args["cabin"]
    if f["seats"][cabin] < 1:
        raise ToolError(f"no {cabin} seats left on {args['flight_id']}")
    booking_id = "BK-" + _short_hash("booking", args["flight_id"], _person(passenger), cabin,
                                     len(state["bookings"]))
    f["seats"][cabin] -= 1
    state["bookings"][booking_id] = {"flight_id": args["flight_id"], "passenger": passenger,
                                     "cabin": cabin, "price": f["price"][cabin],
                                     "status": "active", "refund": None}
    effect = {"op": "book_flight", "flight_id": args["flight_id"],
              "passenger": _person(passenger), "cabin": cabin}
    return _booking_view(booking_id, state["bookings"][booking_id]), effect


def flight_cancel_booking(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    b = state["bookings"].get(args["booking_id"])
    if b is None:
        raise ToolError(f"no booking with id {safe_text(args['booking_id'])}")
    if b["status"] != "active":
        raise ToolError(f"booking {args['booking_id']} is already {b['status']}")
    b["status"], b["refund"] = "cancelled", refund_cents(b["cabin"], b["price"])
    state["flights"][b["flight_id"]]["seats"][b["cabin"]] += 1
    effect = {"op": "cancel_booking", "booking_id": args["booking_id"]}
    return _booking_view(args["booking_id"], b), effect


def flight_get_booking(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    b = state["bookings"].get(args["booking_id"])
    if b is None:
        raise ToolError(f"no booking with id {safe_text(args['booking_id'])}")
    return _booking_view(args["booking_id"], b), None


def flight_list_bookings(state: JSON, args: JSON) -> tuple[JSON, JSON | None]:
    who = _person(_text_arg(args, "passenger"))
    return {"bookings": [_booking_view(i, b) for i, b in sorted(state["bookings"].items())
                         if _person(b["passenger"]) == who]}, None


_AIRPORT = {"type": "string", "enum": list(AIRPORTS)}
FLIGHT = World("flight", {t.name: t for t in (
    Tool("search_flights", "List the flights on a route and date (YYYY-MM-DD), earliest "
         "first, with both cabins' prices and free seats.",
         _obj({"origin": _AIRPORT, "destination": _AIRPORT, "date": _STR},
              ["origin", "destination", "date"]), flight_search_flights),
    Tool("get_flight", "Show one flight.", _obj({"flight_id": _STR}, ["flight_id"]),
         flight_get_flight),
    Tool("book_flight", "Book a seat for a passenger in a cabin; charges the cabin's price. "
         "Irreversible.",
         _obj({"flight_id": _STR, "passenger": _STR,
               "cabin": {"type": "string", "enum": list(CABINS)}},
              ["flight_id", "passenger", "cabin"]),
         flight_book_flight, irreversible=True),
    Tool("cancel_booking", "Cancel an active booking; economy refunds 80% of the price, "
         "business 100%. Irreversible.",
         _obj({"booking_id": _STR}, ["booking_id"]), flight_cancel_booking, irreversible=True),
    Tool("get_booking", "Show one booking.", _obj({"booking_id": _STR}, ["booking_id"]),
         flight_get_booking),
    Tool("list_bookings", "List a passenger's bookings (active and cancelled).",
         _obj({"passenger": _STR}, ["passenger"]), flight_list_bookings),
)})

WORLDS: dict[str, World] = {"shop": SHOP, "flight": FLIGHT}


# =========================================================================== tasks


@dataclass(frozen=True)
class TaskSpec:
    """One generated task before it becomes a ``Task`` (see ``SglsEnv.generate_tasks``)."""

    world: str
    kind: str
    question: str
    state: JSON
    gold: list[list[JSON]]  # steps of {"name", "arguments"}
    effects: list[JSON]  # irreversible effects of the gold calls, in order
    facts: list[str]  # what a correct reply states (ids as text, amounts as numbers)
    answer: str  # a reference reply stating every fact


class _GoldRun:
    """Runs gold steps on a copy of the initial state, recording calls and effects."""

    def __init__(self, world: World, state: JSON) -> None:
        self.world, self.sim = world, copy.deepcopy(state)
        self.steps: list[list[JSON]] = []
        self.effects: list[JSON] = []

    def step(self, *calls: tuple[str, JSON]) -> list[JSON]:
        responses = []
        for name, args in calls:
            response, effect = self.world.call(self.sim, name, args)  # gold never errs
            responses.append(response)
            if effect is not None:
                self.effects.append(effect)
        self.steps.append([{"name": n, "arguments": a} for n, a in calls])
        return responses


def _shop_state(rng: random.Random, focus: str) -> JSON:
    """A catalog of ~10 items over three categories including ``focus``; distinct prices."""
    cats = [focus, *rng.sample([c for c in CATEGORIES if c != focus], 2)]
    ids = rng.sample(range(1000, 10000), 4 * len(cats))
    items: JSON = {}
    for ci, cat in enumerate(cats):
        n = 4 if cat == focus else rng.randint(2, 4)
        adjectives = rng.sample(_ADJECTIVES, n)
        prices = rng.sample(range(5, 200), n)
        for k in range(n):
            items[f"SKU-{ids[4 * ci + k]}"] = {
                "name": f"{adjectives[k]} {_SINGULAR[cat]}", "category": cat,
                "price": prices[k] * 100 + rng.choice((0, 49, 99)), "stock": rng.randint(0, 9)}
    return {"items": items, "cart": {}, "orders": {}}


def _in_category(state: JSON, cat: str) -> list[str]:
    return sorted((i for i, it in state["items"].items() if it["category"] == cat),
                  key=lambda i: (state["items"][i]["price"], i))


def shop_buy_cheapest(rng: random.Random) -> TaskSpec:
    cat = rng.choice(CATEGORIES)
    state = _shop_state(rng, cat)
    qty = rng.randint(1, 3)
    ranked = _in_category(state, cat)
    # Half the time the cheapest lacks the stock; some other item surely has it.
    short = rng.random() < 0.5
    if short:
        state["items"][ranked[0]]["stock"] = rng.randint(0, qty - 1)
    pick = ranked[rng.randrange(int(short), len(ranked))]
    state["items"][pick]["stock"] = max(state["items"][pick]["stock"], rng.randint(qty, 9))
    target = next(i for i in ranked if state["items"][i]["stock"] >= qty)
    shipping, method = rng.choice(list(SHIPPING_CENTS)), rng.choice(PAY_METHODS)
    run = _GoldRun(SHOP, state)
    run.step(("search_items", {"category": cat}))
    run.step(("add_to_cart", {"item_id": target, "quantity": qty}))
    order = run.step(("place_order", {"shipping": shipping}))[0]
    run.step(("pay_order", {"order_id": order["order_id"], "method": method}))
    total = run.sim["orders"][order["order_id"]]["total"]
    unit = "unit" if qty == 1 else "units"
    question = (f"Buy {qty} {unit} of the cheapest item in the {cat} category that has at "
                f"least {qty} in stock, with {shipping} shipping, and pay by {method}. "
                "Tell me the order id and the total charged.")
    answer = (f"I bought {qty} x {target} (order {order['order_id']}, {shipping} shipping) "
              f"and paid by {method}; the total charged was ${_fmt_money(total)}.")
    return TaskSpec("shop", "buy_cheapest", question, state, run.steps, run.effects,
                    [order["order_id"], _fmt_money(total)], answer)


def shop_compare_buy(rng: random.Random) -> TaskSpec:
    cat = rng.choice(CATEGORIES)
    state = _shop_state(rng, cat)
    a, b = rng.sample(_in_category(state, cat), 2)
    for i in (a, b):
        state["items"][i]["stock"] = max(1, state["items"][i]["stock"])
    cheaper = min((a, b), key=lambda i: state["items"][i]["price"])
    run = _GoldRun(SHOP, state)
    run.step(("get_item", {"item_id": a}), ("get_item", {"item_id": b}))
    run.step(("add_to_cart", {"item_id": cheaper, "quantity": 1}))
    order = run.step(("place_order", {"shipping": "standard"}))[0]
    total = run.sim["orders"][order["order_id"]]["total"]
    question = (f"Compare items {a} and {b} and order one unit of the cheaper one with "
                "standard shipping. Do not pay yet. Tell me the order id and the total.")
    answer = (f"{cheaper} is the cheaper one; I placed order {order['order_id']} for one unit "
              f"with standard shipping, total ${_fmt_money(total)} (not paid yet).")
    return TaskSpec("shop", "compare_buy", question, state, run.steps, run.effects,
                    [order["order_id"], _fmt_money(total)], answer)


def shop_price_check(rng: random.Random) -> TaskSpec:
    cat = rng.choice(CATEGORIES)
    state = _shop_state(rng, cat)
    target = rng.choice(_in_category(state, cat))
    item = state["items"][target]
    run = _GoldRun(SHOP, state)
    run.step(("get_item", {"item_id": target}))
    question = f"How much does item {target} cost, and how many units are in stock?"
    answer = (f"Item {target} ({item['name']}) costs ${_fmt_money(item['price'])} and "
              f"there are {item['stock']} units in stock.")
    return TaskSpec("shop", "price_check", question, state, run.steps, run.effects,
                    [_fmt_money(item["price"]), str(item["stock"])], answer)


def _flight_state(rng: random.Random, route: tuple[str, str], dates: list[str]) -> JSON:
    """3-5 flights on ``route`` for each of ``dates`` plus 4 distractors; distinct prices."""
    ids = rng.sample(range(100, 1000), 30)
    flights: JSON = {}
    legs = [(route, d) for d in dates for _ in range(rng.randint(3, 5))]
    for _ in range(4):
        o, d = rng.sample(AIRPORTS, 2)
        legs.append(((o, d), rng.choice(dates)))
    departs = rng.sample(range(6 * 12, 22 * 12), len(legs))  # 5-minute slots, 06:00-21:55
    economy = rng.sample(range(89, 500), len(legs))
    business = rng.sample(range(520, 1600), len(legs))
    for k, ((o, d), date) in enumerate(legs):
        flights[f"FL{ids[k]}"] = {
            "origin": o, "destination": d, "date": date,
            "depart": f"{departs[k] // 12:02d}:{departs[k] % 12 * 5:02d}",
            "price": {"economy": economy[k] * 100, "business": business[k] * 100},
            "seats": {"economy": rng.randint(0, 9), "business": rng.randint(0, 4)}}
    return {"flights": flights, "bookings": {}}


def _on(state: JSON, route: tuple[str, str], date: str) -> list[str]:
    return sorted(i for i, f in state["flights"].items()
                  if (f["origin"], f["destination"], f["date"]) == (*route, date))


def _dates(rng: random.Random, n: int) -> list[str]:
    return [f"2025-{rng.randint(1, 12):02d}-{day:02d}" for day in rng.sample(range(1, 29), n)]


def _book_first(rng: random.Random, order: str) -> TaskSpec:
    o, d = rng.sample(AIRPORTS, 2)
    route = (o, d)
    (date,) = _dates(rng, 1)
    state = _flight_state(rng, (o, d), [date])
    cabin = rng.choice(CABINS)
    passenger = rng.choice(_PASSENGERS)
    on_route = _on(state, route, date)
    key: Callable[[str], Any] = ((lambda i: state["flights"][i]["price"][cabin])
                                 if order == "cheapest" else
                                 (lambda i: state["flights"][i]["depart"]))
    ranked = sorted(on_route, key=key)
    # Half the time the first choice is full; some later flight surely has a seat.
    full = rng.random() < 0.5
    if full:
        state["flights"][ranked[0]]["seats"][cabin] = 0
    pick = state["flights"][ranked[rng.randrange(int(full), len(ranked))]]["seats"]
    pick[cabin] = max(pick[cabin], 1)
    target = next(i for i in ranked if state["flights"][i]["seats"][cabin] > 0)
    run = _GoldRun(FLIGHT, state)
    run.step(("search_flights", {"origin": o, "destination": d, "date": date}))
    booking = run.step(("book_flight", {"flight_id": target, "passenger": passenger,
                                        "cabin": cabin}))[0]
    price = state["flights"][target]["price"][cabin]
    what = "cheapest" if order == "cheapest" else "earliest"
    question = (f"Book the {what} flight from {o} to {d} on {date} that has a free {cabin} "
                f"seat, in {cabin}, for {passenger}. Tell me the booking id, the flight "
                "number and the price.")
    answer = (f"Booked {passenger} on flight {target} ({cabin}), booking "
              f"{booking['booking_id']}, price ${_fmt_money(price)}.")
    return TaskSpec("flight", f"book_{what}", question, state, run.steps, run.effects,
                    [booking["booking_id"], target, _fmt_money(price)], answer)


def flight_book_cheapest(rng: random.Random) -> TaskSpec:
    return _book_first(rng, "cheapest")


def flight_book_earliest(rng: random.Random) -> TaskSpec:
    return _book_first(rng, "earliest")


def _seed_bookings(state: JSON, rng: random.Random, passenger: str,
                   flights: list[str]) -> list[str]:
    """Pre-existing bookings (not effects of the episode): ``passenger`` on each flight
    in economy, plus one for someone else."""
    other = rng.choice([p for p in _PASSENGERS if p != passenger])
    ids = []
    for who, fid in [*((passenger, f) for f in flights), (other, flights[0])]:
        state["flights"][fid]["seats"]["economy"] = max(1, state["flights"][fid]["seats"][
            "economy"])
        ids.append(flight_book_flight(state, {"flight_id": fid, "passenger": who,
                                              "cabin": "economy"})[0]["booking_id"])
    return ids[:-1]


def flight_cancel(rng: random.Random) -> TaskSpec:
    o, d = rng.sample(AIRPORTS, 2)
    dates = _dates(rng, 2)
    state = _flight_state(rng, (o, d), dates)
    passenger = rng.choice(_PASSENGERS)
    mine = [rng.choice(_on(state, (o, d), day)) for day in dates]
    booking_ids = _seed_bookings(state, rng, passenger, mine)
    k = rng.randrange(2)
    run = _GoldRun(FLIGHT, state)
    run.step(("list_bookings", {"passenger": passenger}))
    cancelled = run.step(("cancel_booking", {"booking_id": booking_ids[k]}))[0]
    refund = run.sim["bookings"][booking_ids[k]]["refund"]
    question = (f"{passenger} wants to cancel their booking on flight {mine[k]}. Cancel it "
                "and tell me the booking id and the refund.")
    answer = (f"Cancelled booking {cancelled['booking_id']} on flight {mine[k]} for "
              f"{passenger}; the refund is ${_fmt_money(refund)}.")
    return TaskSpec("flight", "cancel", question, state, run.steps, run.effects,
                    [booking_ids[k], _fmt_money(refund)], answer)


def flight_rebook(rng: random.Random) -> TaskSpec:
    o, d = rng.sample(AIRPORTS, 2)
    route = (o, d)
    old_date, new_date = _dates(rng, 2)
    state = _flight_state(rng, (o, d), [old_date, new_date])
    passenger = rng.choice(_PASSENGERS)
    old_flight = rng.choice(_on(state, route, old_date))
    (old_booking,) = _seed_bookings(state, rng, passenger, [old_flight])
    ranked = sorted(_on(state, route, new_date),
                    key=lambda i: state["flights"][i]["price"]["economy"])
    state["flights"][ranked[rng.randrange(len(ranked))]]["seats"]["economy"] = rng.randint(1, 4)
    target = next(i for i in ranked if state["flights"][i]["seats"]["economy"] > 0)
    run = _GoldRun(FLIGHT, state)
    run.step(("list_bookings", {"passenger": passenger}),
             ("search_flights", {"origin": o, "destination": d, "date": new_date}))
    _, booking = run.step(("cancel_booking", {"booking_id": old_booking}),
                          ("book_flight", {"flight_id": target, "passenger": passenger,
                                           "cabin": "economy"}))
    refund = run.sim["bookings"][old_booking]["refund"]
    question = (f"{passenger} is booked from {o} to {d} on {old_date} and wants to move to "
                f"the cheapest economy flight with a free seat on {new_date}. Cancel the old "
                "booking, book the new flight in economy, and tell me the new booking id, "
                "the new flight number and the refund for the old booking.")
    answer = (f"Cancelled {old_booking} (refund ${_fmt_money(refund)}) and booked "
              f"{passenger} on flight {target} in economy, booking {booking['booking_id']}.")
    return TaskSpec("flight", "rebook", question, state, run.steps, run.effects,
                    [booking["booking_id"], target, _fmt_money(refund)], answer)


TASK_KINDS: dict[str, dict[str, Callable[[random.Random], TaskSpec]]] = {
    "shop": {"buy_cheapest": shop_buy_cheapest, "compare_buy": shop_compare_buy,
             "price_check": shop_price_check},
    "flight": {"book_cheapest": flight_book_cheapest, "book_earliest": flight_book_earliest,
               "cancel": flight_cancel, "rebook": flight_rebook},
}
