"""A trace's scalars in TensorBoard, through ``torch.utils.tensorboard`` (needs the ``tensorboard`` extra).

    from ampaudit.report.tensorboard import write_tensorboard
    events, _ = read_trace("run.jsonl")
    n = write_tensorboard(events, "runs/amp")      # number of scalar points written
    # ampaudit report run.jsonl --tensorboard runs/amp   and   ampaudit train ... --tensorboard runs/amp

Tags (``<top>`` names the top module):
    train/loss, train/loss_scale, train/loss_scale_log2, train/skipped, train/skipped_total, train/grad_norm,
    train/clipped, train/lr, train/step_time
    headroom/<phase>/<module>          headroom_bits of each ``stats`` event (bits left below the dtype's max)
    absmax/<phase>/<module>
    divergence/<scope>/<module>/rel_l2 and .../sqnr_db    (scope "grad" uses the parameter name)
    eval/<name>/autocast, eval/<name>/fp32, eval/<name>/gap   per ``eval`` event (<name>: loss or a metric)
    nonfinite/count, plus a text entry "nonfinite" per origin and "skip" per skipped step naming the modules.
Non-finite values (a skipped step's inf grad norm) are not plotted: the ``train/skipped`` series shows them.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable

from ampaudit.errors import UsageError
from ampaudit.extras import require
from ampaudit.report.trace_summary import TraceData, collect

TOP = "<top>"


def _ok(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _name(module: str | None) -> str:
    return module or TOP


class _Scalars:
    """Counts what it writes, and drops what TensorBoard cannot plot."""

    def __init__(self, writer: Any):
        self.writer, self.count = writer, 0

    def add(self, tag: str, value: float | None, step: int | None) -> None:
        if _ok(value) and step is not None:
            self.writer.add_scalar(tag, float(value), global_step=int(step))
            self.count += 1


def _steps(out: _Scalars, data: TraceData) -> None:
    skipped_total = 0
    for r in data.steps:
        skipped_total += r.skipped
        out.add("train/loss", r.loss, r.step)
        out.add("train/loss_scale", r.scale, r.step)
        out.add("train/loss_scale_log2", math.log2(r.scale) if r.scale else None, r.step)
        out.add("train/skipped", float(r.skipped), r.step)
        out.add("train/skipped_total", float(skipped_total), r.step)
        out.add("train/grad_norm", r.grad_norm, r.step)
        out.add("train/clipped", float(r.clipped), r.step)
        out.add("train/lr", r.lr, r.step)
        out.add("train/step_time", r.time, r.step)


def _modules(out: _Scalars, data: TraceData) -> None:
    for s in data.stats:
        where = f"{s['phase']}/{_name(s['module'])}"
        out.add(f"headroom/{where}", s["headroom_bits"], s["step"])
        out.add(f"absmax/{where}", s["absmax"], s["step"])
    for d in data.divergence:
        who = d["param"] if d["scope"] == "grad" and d["param"] else _name(d["module"])
        out.add(f"divergence/{d['scope']}/{who}/rel_l2", d["rel_l2"], d["step"])
        out.add(f"divergence/{d['scope']}/{who}/sqnr_db", d["sqnr_db"], d["step"])


def _evals(out: _Scalars, data: TraceData) -> None:
    for row in data.evals:
        for name, q in row["quantities"].items():
            for which in ("autocast", "fp32", "gap"):
                out.add(f"eval/{name}/{which}", q[which], row["step"])


def _texts(writer: Any, out: _Scalars, data: TraceData) -> None:
    for i, ev in enumerate(data.nonfinite, start=1):
        step = ev["step"] if ev["step"] is not None else 0
        out.add("nonfinite/count", float(i), step)
        where = f"{ev['phase']} {ev['kind']} in `{_name(ev['module'])}`"
        detail = ", ".join(x for x in (ev["op"], ev["source"]) if x)
        writer.add_text("nonfinite", where + (f" ({detail})" if detail else ""), global_step=step)
    for s in data.skips:
        if s["step"] is not None:
            mods = ", ".join(f"`{_name(m)}`" for m in s["modules"]) or "no parameter with non-finite gradients"
            writer.add_text("skip", f"step skipped at scale {s['scale']}: {mods}", global_step=s["step"])


def write_tensorboard(events: Iterable[dict], logdir: str | os.PathLike) -> int:
    """Write the scalars of trace ``events`` (as :func:`~ampaudit.runtime.trace.read_trace` returns them) to an
    event file in ``logdir``; return how many scalar points were written."""
    require("tensorboard", extra="tensorboard", feature="--tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    try:
        os.makedirs(logdir, exist_ok=True)
        writer = SummaryWriter(log_dir=str(logdir))
    except OSError as exc:
        raise UsageError(f"cannot write TensorBoard logs to {logdir}: {exc.strerror or exc}",
                         hint="choose a writable folder for --tensorboard") from exc
    data = collect(events)
    out = _Scalars(writer)
    try:
        _steps(out, data)
        _modules(out, data)
        _evals(out, data)
        _texts(writer, out, data)
    finally:
        writer.close()
    return out.count


def writer_at_close(logdir: str | os.PathLike) -> Callable[[list[dict]], int]:
    """What a callback hands its :class:`~ampaudit.runtime.session.WatchSession` as ``on_close`` to write the
    run's scalars to ``logdir`` when training ends; checks now that the tensorboard extra is installed (fail
    before training, not after it)."""
    require("tensorboard", extra="tensorboard", feature="tensorboard=")
    return lambda events: write_tensorboard(events, logdir)
