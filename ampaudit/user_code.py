"""Which source files are the user's own code, as opposed to torch's, Python's or ampaudit's machinery.

    is_user_file("/home/me/model.py")   # True
    is_user_file(torch.nn.functional.__file__), is_user_file("<string>")   # False, False
    is_library_file(transformers.models.bert.modeling_bert.__file__)        # True: an installed package's
    library_path(transformers.models.bert.modeling_bert.__file__)   # "transformers/models/bert/modeling_bert.py"
    frame_kind(filename)                # USER, LIBRARY or None (machinery), the library question asked first

Capture, the runtime locators, ``fix`` (which never edits a file that is not the user's) and the warning filter
(:mod:`ampaudit.quiet`) all ask this one question. :func:`is_library_file` asks the second one the locators need:
a file of an installed package other than torch and ampaudit, such as transformers' modeling code, is a library
model's own code where the model has no line of the user's; :func:`model_packages` says which libraries the model's
classes come from, whose lines are preferred to those of the helpers they call. Installed means below this
interpreter's site folders (a virtualenv's included: ``sysconfig``, ``site``) or below any folder named
``site-packages`` or ``dist-packages`` (another interpreter's, a copied environment).
"""
from __future__ import annotations

import functools
import os
import site
import sysconfig
from pathlib import Path

import torch
from torch import nn


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
    """Whether ``filename`` is the user's own code: a real file, not torch's, ampaudit's, Python's or an installed
    package's."""
    resolved = _resolved(filename)
    return resolved is not None and not resolved.startswith(_SKIP_DIRS) and _installed_root(resolved) is None


@functools.lru_cache(maxsize=None)
def library_dirs() -> tuple[str, ...]:
    """Folders of installed packages (site-packages), resolved, each ending in a separator."""
    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(getattr(site, "getusersitepackages", lambda: None)())
    return tuple(str(Path(d).resolve()) + os.sep for d in dirs if d)


_SITE_FOLDERS = ("site-packages", "dist-packages")


def _installed_root(resolved: str) -> str | None:
    # The site folder ``resolved`` is installed below (ending in a separator): the longest of this interpreter's,
    # else the innermost folder named site-packages or dist-packages on its path; None when it is not installed.
    root = max((d for d in library_dirs() if resolved.startswith(d)), key=len, default=None)
    if root is not None:
        return root
    parts = Path(resolved).parts[:-1]
    at = max((i for i, part in enumerate(parts) if part in _SITE_FOLDERS), default=None)
    return None if at is None else str(Path(*parts[:at + 1])) + os.sep


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package other than torch and ampaudit."""
    resolved = _resolved(filename)
    return resolved is not None and _installed_root(resolved) is not None and not resolved.startswith(_MACHINERY_DIRS)


USER, LIBRARY = "user", "library"


@functools.lru_cache(maxsize=4096)
def library_path(filename: str) -> str | None:
    """``filename`` relative to the site-packages folder it is installed in ("transformers/models/llama/
    modeling_llama.py", "tinylib.py"), with ``/`` separators; None when it is not a library file. Reports name a
    library's line this way: the same for every user, whatever their Python's prefix."""
    if not is_library_file(filename):
        return None
    resolved = _resolved(filename)
    return resolved[len(_installed_root(resolved)):].replace(os.sep, "/")


def library_package(filename: str) -> str | None:
    """The top-level package (or single module, without ``.py``) a library file belongs to: "transformers"."""
    rel = library_path(filename)
    return None if rel is None else rel.split("/", 1)[0].removesuffix(".py")


def model_packages(root: nn.Module | None) -> frozenset[str]:
    """Top-level packages of the classes of ``root``'s modules, other than torch (which never owns a line)."""
    if root is None:
        return frozenset()
    names = {type(m).__module__.split(".", 1)[0] for m in root.modules()}
    return frozenset(names - {"torch", "builtins", "__main__"})


_KINDS: dict[str, tuple[str | None, str | None]] = {}


def frame_kind(filename: str) -> tuple[str | None, str | None]:
    """(USER, None), (LIBRARY, its package) or (None, None) for a frame of torch, ampaudit or Python.

    Asked once per frame of every captured op: a plain dict, filled once per file."""
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
