"""Which source files are the user's own code, as opposed to torch's, Python's or ampaudit's machinery.

    is_user_file("/home/me/model.py")   # True
    is_user_file(torch.nn.functional.__file__), is_user_file("<string>")   # False, False

Capture, the runtime locators and the warning filter (:mod:`ampaudit.quiet`) all ask this one question.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


# Frames from these folders are machinery, not the user's model code.
_SKIP_DIRS = tuple(str(Path(p).resolve()) + os.sep for p in (
    Path(torch.__file__).parent, Path(__file__).resolve().parent, Path(os.__file__).parent,
))


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    try:
        resolved = str(Path(filename).resolve())
    except OSError:
        return False
    return not resolved.startswith(_SKIP_DIRS)
