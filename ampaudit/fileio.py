"""Atomic writes: a reader (or a kill) never sees half a file, and what was there survives a failed write.

    atomic_write_text("report.sarif", text)
    atomic_write_bytes(path, data, hint="choose a writable path for --html")
    atomic_write(path, lambda fh: torch.save(state, fh), error=TrainError)     # streaming, for checkpoints

The one writer of every file ampaudit leaves behind: checkpoints, traces' summaries, reports, fix outputs.
"""
from __future__ import annotations

import os
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
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp files are private (0600); the result gets the mode any new file would.
        os.chmod(tmp, 0o666 & ~_umask())
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
