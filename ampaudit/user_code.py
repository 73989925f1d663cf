"""Which source files are the user's own code, as opposed to torch's, Python's or ampaudit's machinery.

    is_user_file("/home/me/model.py")   # True
    is_user_file(torch.nn.functional.__file__), is_user_file("<string>")   # False, False
    is_library_file(transformers.models.bert.modeling_bert.__file__)        # True: an installed package's
    library_path(transformers.models.bert.modeling_bert.__file__)   # "transformers/models/bert/modeling_bert.py"
    frame_kind(filename)                # USER, LIBRARY or None (machinery), the library question asked first

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


USER, LIBRARY = "user", "library"


@functools.lru_cache(maxsize=4096)
def library_path(filename: str) -> str | None:
    """``filename`` relative to the site-packages folder it is installed in ("transformers/models/llama/
    modeling_llama.py", "tinylib.py"), with ``/`` separators; None when it is not a library file. Reports name a
    library's line this way: the same for every user, whatever their Python's prefix."""
    if not is_library_file(filename):
        return None
    resolved = _resolved(filename)
    root = max((d for d in library_dirs() if resolved.startswith(d)), key=len)
    return resolved[len(root):].replace(os.sep, "/")


def library_package(filename: str) -> str | None:
    """The top-level package (or single module, without ``.py``) a library file belongs to: "transformers"."""
    rel = library_path(filename)
    return None if rel is None else rel.split("/", 1)[0].removesuffix(".py")


_KINDS: dict[str, tuple[str | None, str | None]] = {}


def frame_kind(filename: str) -> tuple[str | None, str | None]:
    """(USER, None), (LIBRARY, its package) or (None, None) for a frame of torch, ampaudit or Python.

    A library file is never the user's, even where :func:`is_user_file` says yes (a virtualenv's site-packages
    lies outside the standard library's folder). Asked once per frame of every captured op: a plain dict, filled
    once per file."""
    kind = _KINDS.get(filename)
    if kind is None:
        package = library_package(filename)
        kind = (LIBRARY, package) if package is not None else ((USER, None) if is_user_file(filename) else (None, None))
        _KINDS[filename] = kind
    return kind


def clear_caches() -> None:
    """Forget every answer (a test that changes what counts as a library folder)."""
    for cached in (_resolved, is_user_file, is_library_file, library_path):
        cached.cache_clear()
    _KINDS.clear()
