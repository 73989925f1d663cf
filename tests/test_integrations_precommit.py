"""The pre-commit hook: its manifest, its runner, and an end-to-end `pre-commit try-repo` run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampaudit.integrations.precommit import main, split_args

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / ".pre-commit-hooks.yaml"

from _shared_models import CLEAN_SOURCE as CLEAN, MISALIGNED_SOURCE as MISALIGNED


def test_manifest_is_valid_for_pre_commit():
    clientlib = pytest.importorskip("pre_commit.clientlib", reason="pre-commit is not installed")
    hooks = {h["id"]: h for h in clientlib.load_manifest(str(MANIFEST))}
    assert set(hooks) == {"ampaudit-check", "ampaudit-check-system"}
    for hook in hooks.values():
        assert hook["entry"] == "python -m ampaudit.integrations.precommit"
        assert hook["pass_filenames"] and hook["require_serial"]
        assert hook["files"] and "python" in hook["types"]


def test_split_args_keeps_option_values_out_of_the_files():
    options, files = split_args(["--device", "cpu", "--fail-on=error", "--select", "AMP1", "--why",
                                 "models/a.py", "models/b.py"])
    assert options == ["--device", "cpu", "--fail-on=error", "--select", "AMP1", "--why"]
    assert files == ["models/a.py", "models/b.py"]


def test_runner_exit_code_is_the_worst_file(tmp_path, capsys):
    (tmp_path / "net.py").write_text(MISALIGNED)
    (tmp_path / "clean.py").write_text(CLEAN)
    assert main([str(tmp_path / "clean.py")]) == 0
    assert main(["--fail-on", "error", str(tmp_path / "net.py")]) == 0
    assert main([str(tmp_path / "clean.py"), str(tmp_path / "net.py")]) == 1
    assert main([str(tmp_path / "net.py"), str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert "model file not found" in err and f"--- {tmp_path / 'missing.py'}" in err
    assert main(["--output", "x.json", str(tmp_path / "net.py")]) == 2
    assert main([]) == 0


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_pre_commit_try_repo_runs_the_hook_on_model_files_only(tmp_path):
    pytest.importorskip("pre_commit", reason="pre-commit is not installed")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    shutil.copy(MANIFEST, hooks / ".pre-commit-hooks.yaml")
    _git(hooks, "init", "-q")
    _git(hooks, "add", "-A")
    _git(hooks, "commit", "-qm", "hooks")
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "net.py").write_text(MISALIGNED)
    (project / "models" / "clean.py").write_text(CLEAN)
    # Not a model file: the hook's `files:` keeps it out (loading it would run it).
    (project / "train_script.py").write_text("raise SystemExit('the hook must not run this file')\n")
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "cache"), "PATH": os.path.dirname(sys.executable)
           + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(hooks), "ampaudit-check-system",
                             "--all-files"], cwd=project, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "AMP101" in out and "models/net.py" in out
    assert "must not run" not in out and "train_script" not in out
