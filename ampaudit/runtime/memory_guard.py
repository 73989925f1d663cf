"""Stop a replay's forward before it takes the machine's last memory, where the kernel's OOM killer would end the
whole process without a word.

    guard = MemoryGuard.from_settings()       # None where the free memory cannot be read (not Linux)
    guard.check()                             # raises MemoryShort when less than the floor is free
    out_of_memory(exc)                        # True for MemoryShort and for torch's own allocation failures

A forward with autograd keeps its activations for the backward: on a CPU the non-finite locator's replay
(:mod:`ampaudit.runtime.locate`) is the largest resident set of a calibration (timm's samvit_base_patch16 at
1024x1024: about 9 GB above the model, bench/calibrate_stages.py ``--memory``). The locator checks the guard
before each op of that forward; when less than ``[calibration] min_free_mib`` (rules/policy/settings.toml) is
free (``MemAvailable`` of /proc/meminfo, and a cgroup v2 ``memory.max`` where one is set) it raises
:class:`MemoryShort`, the graph is dropped, and the forward is replayed without autograd: its forward events
stand, and a note says the backward was not checked and why. Nothing else changes: the comparison with FP32 and
the decision record run without autograd and hold far less.
"""
from __future__ import annotations

import time
from pathlib import Path

from ampaudit.policy import settings

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


class MemoryShort(RuntimeError):
    """Less memory is free than the guard's floor: the forward stops here instead of being killed."""


class MemoryShortWarning(UserWarning):
    """``ampaudit.watch`` replayed a pass without its backward: memory ran short (a check has its note instead)."""


def warn_backward_unchecked(step: int | None) -> None:
    """Tell a watch's user that the replay of ``step`` skipped its backward (a check says so in a note)."""
    import warnings

    warnings.warn(f"ampaudit.watch: memory ran short replaying step {step}: its backward was not checked "
                  "for inf/NaN", MemoryShortWarning, stacklevel=3)


def free_mib() -> float | None:
    """MiB the process can still take: ``MemAvailable``, or less under a cgroup v2 limit; None when unknown."""
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return None
    free = next((int(line.split()[1]) / 1024 for line in text.splitlines() if line.startswith("MemAvailable:")),
                None)
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if free is not None and limit != "max":
            used = int((_CGROUP / "memory.current").read_text())
            free = min(free, (int(limit) - used) / (1 << 20))
    except (OSError, ValueError):
        pass
    return free


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: :class:`MemoryShort`, ``torch.OutOfMemoryError``, or the CPU
    allocator's "can't allocate memory" (a failure of the machine, not of the model's arithmetic)."""
    import torch

    if isinstance(exc, (MemoryShort, MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


class MemoryGuard:
    """:meth:`check` raises :class:`MemoryShort` once less than ``floor_mib`` is free (see the module
    docstring); ``reader`` gives the free MiB (default :func:`free_mib`), read at most every ``every_s``
    seconds (/proc/meminfo costs ~50 us, more than most ops; an op that takes gigabytes takes longer than that
    to write them)."""

    EVERY_S = 0.005

    def __init__(self, floor_mib: float, reader=None, *, every_s: float | None = None):
        self.floor_mib = floor_mib
        self.reader = reader if reader is not None else free_mib
        self.every_s = self.EVERY_S if every_s is None else every_s
        self.lowest: float | None = None      # the least free MiB seen
        self._next = 0.0

    @classmethod
    def from_settings(cls) -> "MemoryGuard | None":
        """The guard of ``[calibration] min_free_mib``; None where free memory cannot be read or the floor is 0."""
        floor = float(settings()["calibration"].get("min_free_mib", 0))
        return cls(floor) if floor > 0 and free_mib() is not None else None

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        free = self.reader()
        if free is None:
            return
        self.lowest = free if self.lowest is None else min(self.lowest, free)
        if free < self.floor_mib:
            raise MemoryShort(f"{free:.0f} MiB of memory left free, under the {self.floor_mib:.0f} MiB floor "
                              "([calibration] min_free_mib)")
