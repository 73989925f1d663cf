"""A reader that leaves early (``ampaudit rules | head -1``) ends the command quietly, as ``yes | head -1`` does.

    watch = PipeWatch()                # before the command runs: is stdout /dev/null already?
    code = watch.exit_code(code)       # after it: 141 when stdout's reader has gone, else ``code``
    code = watch.exit_code(1, broke=True)   # a BrokenPipeError reached the caller

Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError; rich catches its own, points stdout at
/dev/null and exits 1, and typer's echo exits 1 too. Either way the command's real outcome is "the reader left":
exit 128 + SIGPIPE (141, what a shell reports for a writer killed by the signal) with nothing on stderr. The
closed descriptors are pointed at /dev/null so that Python's flush at shutdown has nowhere to fail
("Exception ignored ... BrokenPipeError").
"""
from __future__ import annotations

import os
import select
import sys

PIPE_GONE = 141     # 128 + SIGPIPE (13)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino, a.st_rdev) == (b.st_dev, b.st_ino, b.st_rdev)


def _reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe whose reading end is closed (poll reports POLLERR on its write end)."""
    if not hasattr(select, "poll"):     # Windows: no poll; a BrokenPipeError still says so
        return False
    poller = select.poll()
    try:
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


class PipeWatch:
    """Tells a command that ended because stdout's reader left from one that failed; see the module docstring."""

    def __init__(self) -> None:
        self._devnull_at_start = _same_file(1, os.devnull)

    def _broke(self, code: int) -> bool:
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        except BrokenPipeError:
            return True
        if not self._devnull_at_start and _same_file(1, os.devnull):
            return True     # rich met the broken pipe, put /dev/null in its place and exited 1
        # typer's echo met it and exited 1; a command that finished (0) while its reader left wrote all it had
        return code != 0 and _reader_gone(1)

    def exit_code(self, code: int, broke: bool = False) -> int:
        """``code``, or :data:`PIPE_GONE` when stdout's reader left (``broke``: a BrokenPipeError reached the
        caller); then stdout, and stderr if its reader left too, point at /dev/null."""
        if not (broke or self._broke(code)):
            return code
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            if fd == 1 or _reader_gone(fd):
                os.dup2(devnull, fd)
        os.close(devnull)
        return PIPE_GONE
