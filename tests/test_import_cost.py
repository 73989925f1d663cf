"""Library imports stay lean: the trainer loads rich only for a progress bar that shows."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(statement: str, prefix: str) -> list[str]:
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m == {prefix!r} or m.startswith({prefix + '.'!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return eval(out)


@pytest.mark.slow
def test_import_ampaudit_train_does_not_load_rich():
    assert _loaded_after("import ampaudit.train", "rich") == []


@pytest.mark.slow
def test_a_disabled_progress_bar_does_not_load_rich():
    assert _loaded_after("from ampaudit.train.progress import TrainProgress; TrainProgress(10, enabled=False)",
                         "rich") == []


@pytest.mark.slow
def test_the_cli_registers_its_commands_without_torch():
    # every command module imports torch (and the heavy packages) inside its body, after its arguments are read
    assert _loaded_after("import ampaudit.cli.app; from ampaudit.cli import commands", "torch") == []


@pytest.mark.slow
def test_train_settings_load_without_torch():
    # ampaudit train reads its TrainConfig before it refuses a bad --dtype: that must not cost a torch import
    assert _loaded_after("import ampaudit.train.config", "torch") == []
    assert _loaded_after("from ampaudit.train import TrainConfig", "torch") == []
