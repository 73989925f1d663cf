"""SIGINT/SIGTERM during training: finish the current step, save, and stop cleanly.

    with StopSignals(enabled=True) as stop:
        while ...:
            train_one_step()
            if stop.signum is not None: save(); break

The first signal only sets :attr:`StopSignals.signum`; a second one raises KeyboardInterrupt at once, for a user
who does not want to wait for the step to end. Outside the main thread (where Python cannot install handlers)
this does nothing. The previous handlers come back on exit.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager that turns SIGINT/SIGTERM into a stop request."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        """``"SIGINT"``/``"SIGTERM"`` once one arrived."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopSignals:
        self.signum = None
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
