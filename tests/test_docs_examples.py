"""The examples a new user copies first: the package docstring, README's Python API and its quick start."""
from __future__ import annotations

import re
import textwrap

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def _namespace() -> dict:
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 30), nn.Softmax(-1))
    return {"model": model, "x": torch.randn(8, 30)}


def _run(code: str, ns: dict) -> None:
    # `...` stands for the user's own code: run the lines around it, with one forward as the loop body.
    exec(compile(code.replace("...", "model(x)"), "<example>", "exec"), ns)


def test_package_docstring_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = textwrap.dedent("\n".join(ln for ln in ampaudit.__doc__.splitlines() if ln.startswith("    ")))
    _run(code, _namespace())
    assert "AMP101" in capsys.readouterr().out and (tmp_path / "run.jsonl").is_file()


def test_readme_python_api_example_runs(capsys):
    section = README.split("### Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    _run(code, _namespace())
    assert "AMP101" in capsys.readouterr().out


@pytest.mark.parametrize("command, code", [
    ("ampaudit check samples/char_transformer.py", 1),   # "The first command exits with code 1"
])
def test_readme_quick_start_command(command, code, monkeypatch):
    assert command in README
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, command.split()[1:])
    assert r.exit_code == code, r.output
