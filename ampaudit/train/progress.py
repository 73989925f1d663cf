"""The training progress bar: step, loss, loss scale and skipped steps, on stderr via rich.

    with TrainProgress(total=1000, enabled=True) as bar:
        bar.update(step, loss=0.52, scale=65536.0, skipped=3)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


class TrainProgress:
    """A rich progress bar; a no-op when disabled (non-zero ranks, library use, tests)."""

    def __init__(self, total: int | None, *, enabled: bool, completed: int = 0):
        self._progress: Progress | None = None
        if not enabled:
            return
        # rich is imported only for a bar that shows: library use of the trainer never loads it.
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("scale {task.fields[scale]}"),
            TextColumn("skipped {task.fields[skipped]}"), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False)
        self._task = self._progress.add_task("train", total=total, completed=completed,
                                             loss="-", scale="-", skipped=0)

    def update(self, step: int, *, loss: float, scale: float | None, skipped: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4g}",
                                  scale="off" if scale is None else f"{scale:g}", skipped=skipped)

    def __enter__(self) -> TrainProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
