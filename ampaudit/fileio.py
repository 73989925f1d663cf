"""Atomic writes: a reader (or a kill) never sees half a file, and what was there survives a failed write.

    atomic_write_text("report.sarif", text)
    atomic_write_bytes(path, data, hint="choose a writable path for --html")
    atomic_write(path, lambda fh: torch.save(state, fh), error=TrainError)     # streaming, for checkpoints
    read_only(path)          # True for a file nobody may write (444) or this user may not: fix --write refuses it
    writable_as("--html", path, folder=False)   # a UsageError now, when the path is a folder, not after the work

The one writer of every file ampaudit leaves behind: checkpoints, traces' summaries, reports, fix outputs. A file
that is replaced keeps its permission bits (a 755 script stays executable, a 444 file read-only) and, where this
user may set them, its owner and group; a new file gets the mode any new file would. A symlink is written through:
the file it points to is replaced, the link stays.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from ampaudit.errors import AmpAuditError, UsageError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is; some filesystems refuse O_RDONLY on dirs.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _take_mode(tmp: str, before: os.stat_result | None) -> None:
    # mkstemp files are private (0600): a replaced file's mode (and owner, where allowed) carries over; a new
    # file gets the mode any new file would.
    if before is None:
        os.chmod(tmp, 0o666 & ~_umask())
        return
    os.chmod(tmp, stat.S_IMODE(before.st_mode))
    if hasattr(os, "chown"):
        try:
            os.chown(tmp, before.st_uid, before.st_gid)
        except OSError:
            pass        # another user's file: only root may give it back; the mode is kept all the same


def writable_as(flag: str, path: str | os.PathLike, *, folder: bool) -> None:
    """A UsageError when output ``path`` (given as ``flag``) is the wrong kind of thing to write: a folder where a
    file goes, a file where a folder of logs goes, or a path under a file. Called before the work, so that it is
    not lost at its end. Missing folders above ``path`` are no error: every output of the CLI creates them."""
    p = Path(path)
    above = next((a for a in p.parents if a.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"{flag} {p}: {above} is a file, not a folder", hint=f"name a path in a folder for {flag}")
    if folder and p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p} is a file, not a folder", hint=f"name a folder for {flag}, e.g. {flag} runs/amp")
    if not folder and p.is_dir():
        raise UsageError(f"{flag} {p} is a folder, not a file", hint=f"name the file to write, e.g. {flag} {p / 'run.html'}")


def read_only(path: str | os.PathLike) -> bool:
    """True when ``path`` is an existing file that no one may write (no write bit: 444, even for root) or that
    this user may not."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        return False
    return not (mode & 0o222) or not os.access(p, os.W_OK)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any], *, hint: str = "choose a writable path",
                 error: type[AmpAuditError] = UsageError) -> Path:
    """Call ``write(file_object)`` on a temp file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory. Streaming: ``torch.save`` writes straight to the file, so a checkpoint of many GB is never held
    in memory twice.

    Any OSError becomes a one-line ``error`` (a :class:`UsageError` unless the caller says otherwise) with
    ``hint``; the temp file never outlives the call, and what was at ``path`` survives a failed write.
    """
    target = Path(path)
    tmp = None
    try:
        if target.is_symlink():
            target = target.resolve()
        before = target.stat() if target.is_file() else None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        _take_mode(tmp, before)
        os.replace(tmp, target)
        tmp = None
        _fsync_dir(target.parent)
    except OSError as exc:
        raise error(f"cannot write {target}: {exc.strerror or exc}", hint=hint) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return target


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, hint: str = "choose a writable path") -> Path:
    return atomic_write(path, lambda fh: fh.write(data), hint=hint)


def atomic_write_text(path: str | os.PathLike, text: str, *, hint: str = "choose a writable path") -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), hint=hint)
