"""The fixed text of the ``sgls`` worlds that the tiny policy's tokenizer makes single
tokens (``SglsEnv.tiny_phrases``): the JSON keys of tool responses and the fixed text of
questions and reference replies (``train.envs.sgls_worlds``)."""

from __future__ import annotations

from train.envs.sgls_worlds import AIRPORTS, CABINS, CATEGORIES, PAY_METHODS, SHIPPING_CENTS

# JSON keys of the sgls tool responses (the argument names come from the schemas), by the
# kind of value they hold: strings get the opening quote in their token.
SGLS_STRING_KEYS: tuple[str, ...] = (
    "item_id", "name", "category", "order_id", "shipping", "status", "method", "flight_id",
    "origin", "destination", "date", "depart", "booking_id", "passenger", "cabin", "query")
SGLS_OTHER_KEYS: tuple[str, ...] = (
    "items", "price", "stock", "cart", "quantity", "unit_price", "subtotal", "total",
    "paid_with", "amount", "flights", "price_economy", "price_business", "seats_economy",
    "seats_business", "bookings", "refund", "max_price", "arguments")
# The fixed text of the sgls questions and reference replies (train.envs.sgls_worlds).
SGLS_TEXT_TOKENS: tuple[str, ...] = (
    "Buy ", " units of the cheapest item in the ", " unit of the cheapest item in the ",
    " category that has at least ", " in stock, with ", " shipping, and pay by ",
    ". Tell me the order id and the total charged.", "Compare items ",
    " and order one unit of the cheaper one with standard shipping. Do not pay yet. "
    "Tell me the order id and the total.", "How much does item ",
    " cost, and how many units are in stock?", "Book the cheapest flight from ",
    "Book the earliest flight from ", " that has a free ", " seat, in ",
    ". Tell me the booking id, the flight number and the price.",
    " wants to cancel their booking on flight ",
    ". Cancel it and tell me the booking id and the refund.", " is booked from ",
    " and wants to move to the cheapest economy flight with a free seat on ",
    ". Cancel the old booking, book the new flight in economy, and tell me the new "
    "booking id, the new flight number and the refund for the old booking.",
    "I bought ", " (order ", " shipping) and paid by ", "; the total charged was $",
    " is the cheaper one; I placed order ",
    " for one unit with standard shipping, total $", " (not paid yet).", "Item ",
    ") costs $", " and there are ", " units in stock.", "Booked ", " on flight ",
    "), booking ", ", price $", "Cancelled booking ", "; the refund is $", "Cancelled ",
    " (refund $", ") and booked ", " in economy, booking ", "SKU-", "ORD-", "BK-", "FL",
    "2025-", "null", *CATEGORIES, *SHIPPING_CENTS, *PAY_METHODS, *CABINS, *AIRPORTS,
    "active", "cancelled", "placed", "paid")


__all__ = ["SGLS_OTHER_KEYS", "SGLS_STRING_KEYS", "SGLS_TEXT_TOKENS"]
