"""Names a package imports on first use (PEP 562), so importing it stays cheap (no torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, namespace: dict[str, Any], table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose ``table`` maps each public name
    to the submodule (relative, without the dot) that defines it. A resolved name is cached in
    ``namespace`` (the package's ``globals()``), so later lookups skip ``__getattr__``."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *table])

    return __getattr__, __dir__
