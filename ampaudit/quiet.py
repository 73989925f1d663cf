"""Keep the warnings torch raises while ampaudit captures or calibrates a model off the user's screen.

    with quiet():
        cap = capture_any(model, args, kwargs)    # fx, export and fake-tensor chatter is dropped

Capturing, propagating on fake tensors and re-running a model under another device's autocast make torch warn
about things the user never did (an overridden kernel, a deprecated tracing path, a fake-tensor fallback). A
warning attributed to a file of torch, of ampaudit, of the standard library or of an installed library
(site-packages: torchvision's fake kernels warn while shapes propagate) is machinery talking: it is dropped. One
attributed to the user's own code (the model file, a project checked out or installed in editable mode) concerns
that code and is shown after the block, once per place; so is a library's warning that points at the user's line
(``stacklevel``). ``AMPAUDIT_DEBUG=1`` shows every warning as it is raised.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from functools import lru_cache
from typing import Iterator

from ampaudit.user_code import is_user_file


def debug() -> bool:
    """Whether ``AMPAUDIT_DEBUG`` asks for everything (tracebacks, torch's warnings)."""
    return os.environ.get("AMPAUDIT_DEBUG", "") not in ("", "0", "false")


@lru_cache(maxsize=4096)
def concerns_user(filename: str) -> bool:
    """Whether a warning attributed to ``filename`` is about the user's own code (see the module docstring)."""
    return is_user_file(filename)       # an installed package's file (a virtualenv's too) is not the user's


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Inside: torch's own warnings are dropped; the user's are shown once each when the block ends."""
    if debug():
        yield
        return
    kept: dict[tuple, warnings.WarningMessage] = {}

    def collect(message, category, filename, lineno, file=None, line=None):
        # Called for every warning (filter "always" below): one entry per place, user code only, so a
        # warning raised once per op of a long calibration costs a dict lookup, not a growing list.
        if concerns_user(filename):
            kept.setdefault((category, str(message), filename, lineno),
                            warnings.WarningMessage(message, category, filename, lineno))

    with warnings.catch_warnings():
        # "always": the caller's filters must not turn torch's chatter into errors (-W error) or hide it
        # from ``collect``; they apply again when the user's warnings are re-raised below.
        warnings.simplefilter("always")
        warnings.showwarning = collect
        yield
    for w in kept.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
