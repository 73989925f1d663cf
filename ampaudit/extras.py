"""Optional extras (tensorboard, lightning, transformers, plotly...): import one, or say which extra installs it.

    tb = require("tensorboard", extra="tensorboard", feature="--tensorboard")   # the module, when installed
    # else MissingExtraError: "--tensorboard needs the 'tensorboard' package, which is not installed",
    #                         hint "pip install 'ampaudit[tensorboard]'"
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ampaudit.errors import MissingExtraError


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` saying which extra to install for ``feature``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        name = getattr(exc, "name", None) or top
        if name != top and not name.startswith(top + "."):
            raise  # the package is there but one of its own dependencies is broken: show the real error
        raise MissingExtraError(f"{feature} needs the {top!r} package, which is not installed",
                                hint=f"pip install 'ampaudit[{extra}]'") from exc
