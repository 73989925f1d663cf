"""Warnings that point at the caller's code, however deep inside ampaudit they are raised.

    warn_at_user("BatchNorm layers bn1 normalize over a micro-batch of 2 ...", SmallBatchWarning)

``warnings.warn(stacklevel=N)`` counts frames from the call; when the same warning is reached from a Trainer, the
CLI or a callback, no fixed N lands on the user's line. This walks out of ampaudit's own files (and torch's, which
call back into ampaudit from hooks) and warns from the first frame beyond them, so the warning names the user's
``Trainer(...)`` or ``watch(...)`` line.
"""
from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) or f"{os.sep}torch{os.sep}" in path or filename.startswith("<frozen")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, point at the first frame
    outside ampaudit and torch (the outermost frame when every frame is internal: the CLI)."""
    frame, level = sys._getframe(1), 1          # level 1: the caller, as warnings.warn counts
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` from the first frame outside ampaudit and torch."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
