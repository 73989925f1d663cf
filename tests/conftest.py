"""Shared fixtures: paths to the planted models and to CLI assets, a loader for model files, and torchrun."""
from __future__ import annotations

import importlib.util
import os
import subprocess
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
# `ampaudit train` defaults to the dtype this machine runs natively (bf16 on AVX512-BF16 CPUs, fp16 elsewhere): the
# tests, written for one machine's answer, pin it for themselves and for every process they start;
# tests/test_train_default_dtype.py checks the default itself.
os.environ.setdefault("AMPAUDIT_DEFAULT_DTYPE", "float16")


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


@pytest.fixture
def installed_library(tmp_path, monkeypatch):
    """``install(name, source)``: the module ``source`` imported from a folder counted as an installed package's,
    under the standard library's folder as a pyenv's or a system Python's site-packages is (so is_user_file says
    no, as it does for transformers there)."""
    import ampaudit.user_code as user_code

    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.setattr(user_code, "library_dirs", lambda: (str(folder.resolve()) + os.sep,))
    monkeypatch.setattr(user_code, "_SKIP_DIRS", user_code._SKIP_DIRS + (str(folder.resolve()) + os.sep,))
    user_code.clear_caches()

    def install(name: str, source: str):
        (folder / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    install.folder = folder      # for a whole package: write it there, put the folder on sys.path
    yield install
    user_code.clear_caches()


# torchrun's --standalone picks a free port; on a busy shared machine another process can take it first.
PORT_TROUBLE = ("EADDRINUSE", "Address already in use", "RendezvousConnectionError", "RendezvousTimeoutError")


def worker_env() -> dict:
    """The environment of torchrun workers: one thread each (reductions in a fixed order), this checkout."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun_cmd(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc-per-node N args...`` (a script or ``-m module``), retried once when
    the rendezvous port was taken."""
    for _attempt in range(2):
        done = subprocess.run(torchrun_cmd(*args, nproc=nproc), env=worker_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode == 0 or not any(s in done.stderr for s in PORT_TROUBLE):
            break
    return done


@pytest.fixture
def one_thread():
    """One torch thread in this process, as the torchrun workers have: in-process runs compared with theirs
    reduce in the same order."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cpu_fp16_gap(module, *, grad: bool) -> str | None:
    """Why ``module`` (a model file declaring ``EXPECT["cpu_fp16_unsupported"]``) cannot run under float16 CPU
    autocast on this CPU, with gradients or without (``grad``): the declaration and what the probe of
    ampaudit.machine.kernels says (AMPAUDIT_FORCE_NO_FP16_KERNELS forces it); None when it can, or declares
    nothing. Tests skip with this reason."""
    from ampaudit.machine.kernels import PROBES, fp16_kernel_missing

    declared = getattr(module, "EXPECT", {}).get("cpu_fp16_unsupported")
    missing = [why for name in PROBES if (why := fp16_kernel_missing(name, grad=grad))] if declared else []
    return f"{declared}: {missing[0]}" if missing else None
