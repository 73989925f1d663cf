"""Atomic writes: a reader (or a kill) never sees half a file, and what was there survives a failed write.

    atomic_write_text("report.sarif", text)
    atomic_write_bytes(path, data, hint="choose a writable path for --html")
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ampaudit.errors import UsageError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, hint: str = "choose a writable path") -> Path:
    """Write ``data`` to a temp file beside ``path``, fsync it, then rename it over ``path``.

    Any OSError becomes a one-line :class:`UsageError` with ``hint``; the temp file never outlives the call.
    """
    target = Path(path)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp files are private (0600); the result gets the mode any new file would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}", hint=hint) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return target


def atomic_write_text(path: str | os.PathLike, text: str, *, hint: str = "choose a writable path") -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), hint=hint)
