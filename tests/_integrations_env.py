"""Import an integration's framework for its tests, or skip the module saying why.

lightning (through torchmetrics) and transformers' model classes import torchvision whenever it is installed. The
torchvision wheels on PyPI are CUDA builds whose extension cannot load beside a CPU-only torch (the ``bench``
extra installs one), and ``import torchvision`` then raises. The coverage benchmark's
``bench/coverage_tvops.import_torchvision`` makes it importable; it is applied here first, so these tests exercise
the integrations instead of skipping on an unrelated package.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _torchvision_importable() -> None:
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        try:
            sys.path.insert(0, str(BENCH))
            from coverage_tvops import import_torchvision

            import_torchvision()
        except Exception:  # noqa: BLE001  the framework import below then says what is wrong
            pass
        finally:
            if str(BENCH) in sys.path:
                sys.path.remove(str(BENCH))


def import_or_skip(name: str, extra: str) -> ModuleType:
    """``importlib.import_module(name)``; skip the calling test module when it cannot be imported."""
    _torchvision_importable()
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not installed (pip install 'ampaudit[{extra}]')", allow_module_level=True)
    except Exception as exc:  # noqa: BLE001  installed but broken here
        pytest.skip(f"{name} is installed but cannot be imported: {type(exc).__name__}: {exc}",
                    allow_module_level=True)
