"""A wall-clock limit for work that runs the user's code (a forward that hangs must not hang the tool).

    with time_limit(600, "check"):
        ...

Uses SIGALRM, so it applies on POSIX in the main thread; elsewhere (or with ``seconds <= 0``) it is a no-op.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from ampaudit.errors import AmpAuditError


class TimeLimitExceeded(BaseException):
    """The user's code ran past ``--timeout``.

    A BaseException on purpose, like KeyboardInterrupt: the capture fallbacks and the calibration runs catch
    Exception from the user's forward, and a timeout must not be mistaken for one more failed attempt.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint

    one_line = AmpAuditError.one_line


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    usable = seconds and seconds > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(f"{what} did not finish within {seconds:g} s (the model's forward may hang)",
                                hint="raise --timeout, or check that the forward returns for example_inputs()")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
