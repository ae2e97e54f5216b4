"""A layer's public names, loaded when first used (PEP 562).

Each layer's ``__init__`` lists what other layers may import from it (``__all__``) and the
module that defines each name. The modules load only when a name is first read: a caller
that needs SEScope does not pay for TVM's import (``partune.deployed`` loads in 0.1 s with no
TVM), and a worker process does not import the peers' torch because its layer exports them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, modules: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``modules`` (a submodule's
    name relative to ``package`` -> the names it defines) read from its submodule on first use."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:  # not an export: ``from package import submodule`` goes on to import it
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # read once: later reads skip this hook
        return value

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
