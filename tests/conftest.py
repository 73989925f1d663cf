"""Shared fixtures: paths to the planted models and to CLI assets, and a loader for model files."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).resolve().parent / "assets"
# Small models with a known fp16 fault and the module that causes it (EXPECT). The shared folder beside the
# checkout is the reference; tests/assets/planted keeps a copy so a bare clone tests the same way.
PLANTED = ROOT.parent / "shared" / "planted"
if not PLANTED.is_dir():
    PLANTED = ASSETS / "planted"
SAMPLES = ROOT / "samples"


def load_module(path: Path):
    """Import a model file by path under a unique name."""
    name = f"_t_{path.stem}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_planted(name: str):
    """Import ../shared/planted/<name>.py; skip the test when the folder is absent."""
    if not PLANTED.is_dir():
        pytest.skip(f"planted models not found at {PLANTED}")
    return load_module(PLANTED / f"{name}.py")


@pytest.fixture
def planted():
    """Return a loader for ../shared/planted/<name>.py; skips when the folder is absent."""
    if not PLANTED.is_dir():
        pytest.skip(f"planted models not found at {PLANTED}")

    def get(name: str):
        return load_module(PLANTED / f"{name}.py")

    return get
