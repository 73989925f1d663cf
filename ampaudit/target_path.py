"""Which file a command's target names, checked before anything heavy loads (the CLI refuses a typo at once).

    path = model_file("model.py")      # the resolved Path, or a ModelLoadError: not found, a folder, not .py
    model_file("pkg.module:factory")   # None: an importable spec, not a file

:func:`ampaudit.loading.load_target` runs the same checks; this module imports neither torch nor the model.
"""
from __future__ import annotations

from pathlib import Path

from ampaudit.errors import ModelLoadError


def looks_like_file(target: str) -> bool:
    """Whether ``target`` names a file (``model.py``, a path, something that exists) rather than ``pkg.module``."""
    return target.endswith(".py") or "/" in target or "\\" in target or Path(target).exists()


def check_model_file(path: Path) -> None:
    """A ModelLoadError unless ``path`` is an existing ``.py`` file."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}", hint="check the path, or use pkg.module:factory")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a model file", hint="pass the .py file that builds the model")
    if path.suffix != ".py":
        raise ModelLoadError(f"{path} is not a Python file", hint="pass a .py model file, or pkg.module:factory")


def model_file(target: str) -> Path | None:
    """The model file ``target`` names, resolved and checked; None for a ``pkg.module[:factory]`` spec."""
    target = str(target)
    if not looks_like_file(target):
        return None
    path = Path(target).expanduser().resolve()
    check_model_file(path)
    return path
