"""A package's public names imported on first use (PEP 562), so importing the package costs no torch.

    __getattr__ = lazy_getattr(__name__, globals(), {"Trainer": "ampaudit.train.trainer", ...})
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, namespace: dict[str, Any], exports: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps a name to the module it lives in; the value is
    imported once, then kept in ``namespace`` (the package's globals)."""
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
