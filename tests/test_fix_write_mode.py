"""fix --write edits a file the way an editor does: its mode bits (and owner, where this user may set it) stay, a
read-only file is refused unless --force, and the write is atomic (a failed write leaves the file as it was)."""
from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import UsageError
from ampaudit.fileio import atomic_write_text, read_only

from test_source_fix import ODD

runner = CliRunner()


def _model(tmp_path, mode):
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    os.chmod(path, mode)
    return path


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mode", [0o755, 0o600, 0o664])
def test_write_keeps_the_mode(tmp_path, mode):
    path = _model(tmp_path, mode)
    r = runner.invoke(app, ["fix", str(path), "--write"])
    assert r.exit_code == 0, r.output
    assert path.read_text() != ODD and _mode(path) == mode
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_read_only_file_is_refused_unless_forced(tmp_path):
    path = _model(tmp_path, 0o444)
    r = runner.invoke(app, ["fix", str(path), "--write"])
    assert r.exit_code == 2 and path.read_text() == ODD
    assert f"{path} is read-only (mode 444); nothing written" in r.output and "--force" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["fix", str(path), "--write", "--force"])
    assert r.exit_code == 0, r.output
    assert path.read_text() != ODD and _mode(path) == 0o444


def test_force_needs_write(tmp_path):
    r = runner.invoke(app, ["fix", str(_model(tmp_path, 0o644)), "--diff", "--force"])
    assert r.exit_code == 2 and "--force applies to --write" in r.output


def test_read_only_is_by_mode_even_for_root(tmp_path):
    path = _model(tmp_path, 0o444)
    assert read_only(path)                   # root may write it, but its mode says no one should
    os.chmod(path, 0o644)
    assert not read_only(path) and not read_only(tmp_path / "absent.py")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give a file away")
def test_owner_and_group_are_kept_where_allowed(tmp_path):
    path = _model(tmp_path, 0o640)
    os.chown(path, 4321, 4322)
    atomic_write_text(path, "x = 1\n")
    st = path.stat()
    assert (st.st_uid, st.st_gid, _mode(path)) == (4321, 4322, 0o640)


def test_a_failed_write_leaves_the_file_and_no_temp(tmp_path, monkeypatch):
    path = _model(tmp_path, 0o755)

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(UsageError, match="No space left on device"):
        atomic_write_text(path, "x = 1\n")
    assert path.read_text() == ODD and _mode(path) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["odd.py"]


def test_a_symlink_is_written_through(tmp_path):
    real = _model(tmp_path, 0o755)
    link = tmp_path / "link.py"
    link.symlink_to(real)
    atomic_write_text(link, "x = 1\n")
    assert link.is_symlink() and real.read_text() == "x = 1\n" and _mode(real) == 0o755


def test_a_new_file_gets_the_default_mode(tmp_path):
    mask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "new.txt", "x")
    finally:
        os.umask(mask)
    assert _mode(tmp_path / "new.txt") == 0o644
