"""Library errors name the library's parameters (accum=4); only the CLI says them as flags (--accum 4)."""
from __future__ import annotations

import ast
import re

import pytest
import torch
from torch import nn

from ampaudit.cli.app import speak_flags
from ampaudit.errors import UsageError

from conftest import ROOT

FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# Another program's flags, which a library may well name.
FOREIGN = ("torchrun --",)


def _error_strings(path):
    """Every string constant inside a ``raise ...Error(...)`` / ``...Error(...)`` call of ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")).endswith(
                ("Error", "Halted")):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub.lineno, sub.value


@pytest.mark.parametrize("folder", ["train", "runtime"])
def test_library_errors_name_no_cli_flags(folder):
    found = [f"{p.name}:{line}: {text}" for p in sorted((ROOT / "ampaudit" / folder).glob("*.py"))
             for line, text in _error_strings(p) if FLAG.search(text) and not any(f in text for f in FOREIGN)]
    assert not found, "\n".join(found)


def test_trainer_error_names_the_parameter():
    model = nn.Linear(4, 4)
    with pytest.raises(UsageError) as info:
        from ampaudit.train.trainer import Trainer

        Trainer(model, lambda out, y: out.sum(), [(torch.randn(2, 4), None)], accum=0, device="cpu")
    assert info.value.one_line() == "accum must be >= 1, got 0; e.g. accum=4"


FLAGS = {"accum": "--accum", "resume": "--resume", "opt_level": "--opt-level", "clip_norm": "--clip-norm",
         "checkpoint_dir": "--checkpoint", "dtype": "--dtype"}


@pytest.mark.parametrize("text, said", [
    ("e.g. accum=4", "e.g. --accum 4"),
    ("or drop resume=True to start fresh", "or drop --resume to start fresh"),
    ('use opt_level="O2" (FP32 masters)', "use --opt-level O2 (FP32 masters)"),
    ("drop clip_norm, or pass checkpoint_dir=DIR", "drop --clip-norm, or pass --checkpoint DIR"),
    # plain words stay words; quoted keys and other names stay as written
    ("resume with the same dtype", "resume with the same dtype"),
    ("unknown key 'clip_norm'; max_clip_norm; self.accum=2", "unknown key 'clip_norm'; max_clip_norm; self.accum=2"),
])
def test_cli_says_parameters_as_flags(text, said):
    assert speak_flags(text, FLAGS) == said
