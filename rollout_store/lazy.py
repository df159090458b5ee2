"""Lazy package faces: a package names its public entry points by module path, and each is
imported on first use (so ``import train`` loads no torch, and a module that moves needs
one line of its face changed).

``lazy_face(package, where)`` returns the ``(__getattr__, __all__)`` pair a package's
``__init__`` assigns; ``where`` maps a module path (absolute, or relative to ``package``
when it starts with ``.``) to the names the face takes from it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_face(package: str, where: Mapping[str, Sequence[str]]
              ) -> tuple[Callable[[str], Any], list[str]]:
    """The ``__getattr__`` that imports a face's name from its module on first use, and
    the sorted ``__all__`` of those names."""
    module_of = {name: (package + mod if mod.startswith(".") else mod)
                 for mod, names in where.items() for name in names}

    def getattr_(name: str) -> Any:
        mod = module_of.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(mod), name)

    return getattr_, sorted(module_of)
