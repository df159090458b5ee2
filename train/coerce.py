"""One coercer for every settings dataclass: raw values in, values of the field's type out.

``coerce_fields(cls, raw)`` takes a dataclass type and a mapping of raw values -- text from
the command line (``--set``, ``--param``, ``--sampler-param``) or typed values from TOML or
JSON files -- and returns the values checked against the fields' annotations. One rule for
every entry point:

* **text is parsed** as the field's type: ``int`` (``int("3")``), ``float``
  (``float("1e-3")``), ``bool`` (``true/false/1/0/yes/no``, any case), ``str`` as is,
  ``Literal`` one of its values, ``tuple[T, ...]`` as ``a,b,c`` (each part a ``T``),
  ``dict`` as ``k=v,k2=v2`` or as a JSON object (text starting with ``{``, for values
  that are themselves lists or tables); ``none`` or ``null`` (any case) is ``None`` where
  the field allows ``None``;
* **typed values must have the field's type**: a TOML ``steps = 2.5`` or
  ``progress = 2`` or ``store = 5`` is refused; an ``int`` is accepted for a ``float``
  field, a ``bool`` is never an ``int`` and an ``int`` never a ``bool``; lists (TOML arrays,
  JSON lists) are accepted for tuples;
* **floats are finite**: ``nan`` and ``inf`` are refused (every float setting of the
  project is a rate, a coefficient, a threshold or a bound, where a non-finite value
  silently disables a check or trains on noise).

Settings without a dataclass (an environment's task options, ``TrainConfig.task_params``,
whose names and types the env's ``generate_tasks`` checks) go through ``literal_value``:
text starting with ``{`` or ``[`` is JSON (an object or a list: e.g. reasoning-gym's
``dataset_config={"products": {"max_terms": 2}}``; JSON never runs code), text that reads as
an integer, a finite float or a bool word becomes one, ``a,b,c`` becomes a tuple of such
values, anything else stays text; typed values pass unchanged.

Errors are ``CoerceError`` (a ``ValueError``) with a one-line message naming the field and
the value. ``check_types(obj)`` applies the typed-value rules to a constructed dataclass (its
``__post_init__`` calls it, so Python callers get them too) and ``check_bounds`` the range
rule of integer sizes (``MINIMA`` / ``MAXIMA`` mappings of field names).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

NONE_WORDS = ("none", "null")
TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


class CoerceError(ValueError):
    """A raw value that does not fit its field; the message names the field and value."""


def coerce_fields(cls: type, raw: Mapping[str, Any], what: str = "") -> dict[str, Any]:
    """``raw`` (field name -> raw value) checked and converted by ``cls``'s annotations.

    ``what`` prefixes the messages (e.g. ``"sampler option "``). A name that is not a
    field of ``cls`` is refused, naming the fields."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in names:
            raise CoerceError(f"unknown {what}field {name!r}; fields: {', '.join(names)}")
        out[name] = coerce_value(value, hints[name], f"{what}{name}")
    return out


def coerce_value(value: Any, hint: Any, name: str, text: bool = True) -> Any:
    """One raw value as type ``hint`` (the module's rules); ``name`` is used in errors.
    ``text=False``: strings are not parsed (a typed value must already have the type)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    parse = text and isinstance(value, str)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        members = [a for a in args if a is not type(None)]
        if type(None) in args and (value is None or (
                parse and value.strip().lower() in NONE_WORDS)):
            return None
        errors: list[CoerceError] = []
        for member in members:
            try:
                return coerce_value(value, member, name, text)
            except CoerceError as exc:
                errors.append(exc)
        if len(errors) == 1 and type(None) in args:  # T | None: T's own reason
            raise CoerceError(f"{errors[0]} or none") from None
        raise CoerceError(f"{name}={value!r}: expected {_describe(hint)}")
    if value is None:
        raise CoerceError(f"{name}=None: expected {_describe(hint)}")
    if origin is typing.Literal:
        if isinstance(value, str) and value in args:
            return value
        raise CoerceError(f"{name} must be one of {list(args)}, got {value!r}")
    if hint is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if parse:
            word = value.strip().lower()
            if word in TRUE_WORDS:
                return True
            if word in FALSE_WORDS:
                return False
        raise CoerceError(f"{name}={value!r}: expected true or false")
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
            return int(value)
        if parse:
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise CoerceError(f"{name}={value!r}: expected int (a whole number)")
    if hint is float:
        number: float | None = None
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
            number = float(value)
        elif parse:
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is None:
            raise CoerceError(f"{name}={value!r}: expected float")
        if not math.isfinite(number):
            raise CoerceError(f"{name}={value!r}: expected a finite float (not nan or inf)")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise CoerceError(f"{name}={value!r}: expected a string")
    if origin is tuple or hint is tuple:
        inner = args[0] if args else Any
        if parse:
            parts: list[Any] = [p.strip() for p in value.split(",") if p.strip()]
        elif isinstance(value, (list, tuple)):
            parts = list(value)
        else:
            raise CoerceError(f"{name}={value!r}: expected a list (a,b,c)")
        return tuple(coerce_value(p, inner, name, text) for p in parts)
    if origin is dict or hint is dict:
        if isinstance(value, Mapping):
            return dict(value)
        if parse and value.lstrip().startswith("{"):
            found = json_text(value, name)
            if not isinstance(found, dict):
                raise CoerceError(f"{name}: expected a JSON object, got {value!r}")
            return found
        if parse:  # "k=v,k2=v2"
            table: dict[str, str] = {}
            for pair in filter(None, (p.strip() for p in value.split(","))):
                key, sep, val = pair.partition("=")
                if not sep or not key.strip():
                    raise CoerceError(f"{name}: expected KEY=VALUE pairs, got {pair!r}")
                table[key.strip()] = val.strip()
            return table
        raise CoerceError(f"{name}={value!r}: expected a table of KEY=VALUE")
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise CoerceError(f"{name}={value!r}: expected {hint}")


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join("none" if a is type(None) else _describe(a) for a in args)
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {list(args)}"
    return {bool: "true or false", int: "int", float: "float", str: "a string"}.get(
        hint, str(hint))


def check_types(obj: Any) -> None:
    """Raise ``CoerceError`` naming the first field of the dataclass instance ``obj`` whose
    value does not have the field's type, or is a non-finite float (the typed-value rules
    of ``coerce_value``, strings never parsed): what ``__post_init__`` calls, so configs
    built in Python follow the command line's rules."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        coerce_value(getattr(obj, f.name), hints[f.name], f.name, text=False)


def check_bounds(obj: Any, minima: Mapping[str, int], maxima: Mapping[str, int]) -> None:
    """Raise ``CoerceError`` for the first field of ``obj`` below its minimum or above its
    maximum (``minima`` / ``maxima``: field name -> bound, inclusive). None values, and
    names ``obj`` has no field of, are skipped (one table can serve several dataclasses);
    a tuple is checked element by element."""
    for bounds, low_side in ((minima, True), (maxima, False)):
        for name, bound in bounds.items():
            value = getattr(obj, name, None)
            for v in value if isinstance(value, tuple) else (value,):
                if v is None:
                    continue
                if low_side and v < bound:
                    raise CoerceError(f"{name} must be >= {bound}, got {value}")
                if not low_side and v > bound:
                    raise CoerceError(f"{name} must be <= {bound}, got {value}")


def json_text(text: str, name: str = "") -> Any:
    """``text`` parsed as JSON (``json.loads``: data only, no code), with non-finite numbers
    refused; a ``CoerceError`` naming ``name`` for text that is not JSON."""
    def refuse(word: str) -> Any:
        raise CoerceError(f"{name}: {word} is not a finite number")

    def finite(word: str) -> float:  # 1e999 parses as inf
        number = float(word)
        return number if math.isfinite(number) else refuse(word)

    try:
        return json.loads(text, parse_constant=refuse, parse_float=finite)
    except json.JSONDecodeError as exc:
        raise CoerceError(f"{name}: {text!r} is not valid JSON ({exc.msg} at character "
                          f"{exc.pos})") from None


def literal_value(value: Any, name: str = "") -> Any:
    """An untyped setting's value (module docstring): ``"12,18"`` -> ``(12, 18)``,
    ``"3"`` -> ``3``, ``"0.5"`` -> ``0.5``, ``"true"`` -> ``True``, ``"x"`` -> ``"x"``.
    A non-finite float (text or typed) is a ``CoerceError``."""
    if not isinstance(value, str):
        if isinstance(value, float) and not math.isfinite(value):
            raise CoerceError(f"{name}: {value!r} is not a finite number")
        if isinstance(value, list):
            return tuple(literal_value(v, name) for v in value)
        return value
    text = value.strip()
    if text[:1] in ("{", "["):
        return json_text(text, name)
    if "," in text:
        return tuple(literal_value(part, name) for part in text.split(",") if part.strip())
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number):
        raise CoerceError(f"{name}: {value!r} is not a finite number")
    return number


__all__ = ["CoerceError", "check_bounds", "check_types", "coerce_fields", "coerce_value",
           "json_text", "literal_value"]
