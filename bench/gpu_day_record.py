"""What bench/gpu_day.py writes, and the time it may take: one JSON and one markdown table, rewritten after
every figure, and the budget its parts share.

    record = Record(Path("gpu-day"), machine={...})
    record.start("trainer")
    record.figure("trainer", "bf16 O1 tokens/s", 1.2e6, unit="tokens/s", baseline=("fp32 tokens/s", 5e5))
    record.table("policy", "disagreements", [{"op": "softmax", "cuda": "float32", ...}])
    record.finish("trainer", "done")        # or "skipped: no CUDA", "stopped: budget", "error: ..."

    budget = Budget(480, {"policy": 1, "trainer": 3})
    with budget.part("policy", ["policy", "trainer"]) as part:   # its share of what is left, among those
        while not part.expired(): ...

Each write goes to a temporary file renamed over the old one, so a run killed at any moment (a command's time
limit) leaves the last complete JSON and markdown: everything measured until then.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

JSON_NAME, MD_NAME = "gpu_day.json", "gpu_day.md"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)               # a torch.dtype, a device


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


class Record:
    """The run's results, written to ``out/gpu_day.json`` and ``out/gpu_day.md`` after each change."""

    def __init__(self, out: Path, machine: dict):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"machine": machine, "parts": {}}
        self._t0: dict[str, float] = {}
        self.write()

    def part(self, name: str) -> dict:
        return self.data["parts"].setdefault(name, {"status": "pending", "figures": [], "tables": {}})

    def start(self, name: str) -> None:
        self.part(name)["status"] = "running"
        self._t0[name] = time.monotonic()
        self.write()

    def figure(self, part: str, name: str, value: Any, *, unit: str = "", baseline: tuple[str, Any] | None = None,
               note: str = "") -> dict:
        """One figure with what it is compared against: ``baseline`` is (its name, its value); the ratio
        value / baseline is added when both are numbers."""
        row: dict[str, Any] = {"name": name, "value": value, "unit": unit}
        if baseline is not None:
            row["baseline"] = {"name": baseline[0], "value": baseline[1]}
            if isinstance(value, (int, float)) and isinstance(baseline[1], (int, float)) and baseline[1]:
                row["ratio"] = value / baseline[1]
        if note:
            row["note"] = note
        self.part(part)["figures"].append(row)
        self.write()
        return row

    def table(self, part: str, name: str, rows: list[dict]) -> None:
        self.part(part)["tables"][name] = rows
        self.write()

    def finish(self, name: str, status: str) -> None:
        entry = self.part(name)
        entry["status"] = status
        if name in self._t0:
            entry["seconds"] = round(time.monotonic() - self._t0.pop(name), 2)
        self.write()

    def write(self) -> None:
        write_atomic(self.out / JSON_NAME, json.dumps(_jsonable(self.data), indent=1) + "\n")
        write_atomic(self.out / MD_NAME, self.markdown())

    def markdown(self) -> str:
        m = self.data["machine"]
        lines = ["# GPU day", "", " ".join(f"{k}: {_cell(v)};" for k, v in m.items()), ""]
        for name, part in self.data["parts"].items():
            took = f", {part['seconds']} s" if "seconds" in part else ""
            lines += [f"## {name} ({part['status']}{took})", ""]
            if part["figures"]:
                lines += ["| figure | value | unit | baseline | baseline value | ratio | note |",
                          "|---|---|---|---|---|---|---|"]
                for f in part["figures"]:
                    base = f.get("baseline", {})
                    ratio = f"{f['ratio']:.3f}x" if "ratio" in f else ""
                    lines.append(f"| {_cell(f['name'])} | {_cell(f['value'])} | {f['unit']} | "
                                 f"{_cell(base.get('name', ''))} | {_cell(base.get('value', ''))} | {ratio} | "
                                 f"{_cell(f.get('note', ''))} |")
                lines.append("")
            for title, rows in part["tables"].items():
                lines += [f"{title}: {len(rows)} row(s)", ""]
                if rows:
                    keys = list(dict.fromkeys(k for r in rows for k in r))
                    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
                lines.append("")
        return "\n".join(lines) + "\n"


class BudgetExceeded(BaseException):
    """The whole run's time is up (raised by the alarm :meth:`Budget.hard_stop` sets). A BaseException, as
    KeyboardInterrupt is: a part's ``except Exception`` around one measurement must not swallow it."""


class PartBudget:
    """One part's seconds, from when it starts; ``stopped`` is for the part to say it ran out."""

    def __init__(self, seconds: float, clock: Callable[[], float]):
        self.seconds, self._clock = seconds, clock
        self._end = clock() + seconds
        self.stopped = False

    def left(self) -> float:
        return self._end - self._clock()

    def expired(self) -> bool:
        return self.left() <= 0


class Budget:
    """``total_s`` seconds shared by parts in proportion to ``shares``; a part gets its share of what is left
    when it starts (time a part leaves unused goes to the parts after it)."""

    def __init__(self, total_s: float, shares: dict[str, float], clock: Callable[[], float] = time.monotonic):
        self.total_s, self.shares, self._clock = total_s, dict(shares), clock
        self._end = clock() + total_s

    def left(self) -> float:
        return self._end - self._clock()

    def split(self, names: list[str]) -> dict[str, float]:
        """Seconds each of ``names`` gets if every part uses its whole share (what --dry-run prints)."""
        total = sum(self.shares[n] for n in names) or 1.0
        return {n: self.total_s * self.shares[n] / total for n in names}

    @contextlib.contextmanager
    def part(self, name: str, still_to_run: list[str]) -> Iterator[PartBudget]:
        total = sum(self.shares[n] for n in still_to_run) or 1.0
        yield PartBudget(max(0.0, self.left()) * self.shares[name] / total, self._clock)

    @contextlib.contextmanager
    def hard_stop(self, grace_s: float) -> Iterator[None]:
        """Raise :class:`BudgetExceeded` in the main thread ``grace_s`` after the budget ends: a part stuck in
        one long measurement is stopped there, and what was recorded stays."""
        if not hasattr(signal, "setitimer"):
            yield
            return

        def alarm(signum, frame):
            raise BudgetExceeded(f"the {self.total_s:g} s budget (+{grace_s:g} s grace) is spent")

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, self.left() + grace_s))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
