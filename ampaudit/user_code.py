"""Which source files are the user's own code, as opposed to torch's, Python's or ampaudit's machinery.

    is_user_file("/home/me/model.py")   # True
    is_user_file(torch.nn.functional.__file__), is_user_file("<string>")   # False, False
    is_library_file(transformers.models.bert.modeling_bert.__file__)        # True: an installed package's

Capture, the runtime locators and the warning filter (:mod:`ampaudit.quiet`) all ask this one question.
:func:`is_library_file` asks the second one the runtime locators need: a file of an installed package (in
site-packages) other than torch and ampaudit, such as transformers' modeling code, is a library model's own code
where the model has no line of the user's.
"""
from __future__ import annotations

import functools
import os
import site
import sysconfig
from pathlib import Path

import torch


# Frames from these folders are machinery, not the user's model code.
_MACHINERY_DIRS = tuple(str(Path(p).resolve()) + os.sep for p in (Path(torch.__file__).parent,
                                                                 Path(__file__).resolve().parent))
_SKIP_DIRS = _MACHINERY_DIRS + (str(Path(os.__file__).parent.resolve()) + os.sep,)


@functools.lru_cache(maxsize=4096)
def _resolved(filename: str) -> str | None:
    # A real file's resolved path; None for "<stdin>"-like names and paths that cannot be resolved.
    if filename.startswith("<"):
        return None
    try:
        return str(Path(filename).resolve())
    except OSError:
        return None


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    resolved = _resolved(filename)
    return resolved is not None and not resolved.startswith(_SKIP_DIRS)


@functools.lru_cache(maxsize=None)
def library_dirs() -> tuple[str, ...]:
    """Folders of installed packages (site-packages), resolved, each ending in a separator."""
    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(getattr(site, "getusersitepackages", lambda: None)())
    return tuple(str(Path(d).resolve()) + os.sep for d in dirs if d)


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package other than torch and ampaudit."""
    resolved = _resolved(filename)
    return resolved is not None and resolved.startswith(library_dirs()) and not resolved.startswith(_MACHINERY_DIRS)
