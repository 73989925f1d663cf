"""The plotly figures of the HTML report, one function per plot, each from a :class:`TraceData`.

    from ampaudit.report.html_plots import FIGURES
    for key, title, build, empty_text in FIGURES:
        fig = build(data)   # a plotly Figure, or None when the trace has nothing to plot there

Needs plotly (the ``report`` extra); importing this module without it raises ``ModuleNotFoundError``.
"""
from __future__ import annotations

import math
from typing import Callable

import plotly.graph_objects as go

from ampaudit.report.grad_hist_plot import grad_hist_figure
from ampaudit.report.html_eval import eval_figure
from ampaudit.report.html_precursors import precursor_figure
from ampaudit.report.trace_advice import THRESHOLDS
from ampaudit.report.trace_divergence import divergence_culprits, divergence_table, rank_by_verdict
from ampaudit.report.trace_data import TraceData
from ampaudit.report.trace_summary import headroom_table

# Heatmap and bar charts stay readable up to this many modules; the worst ones are kept.
MAX_MODULES = 40
# An SVG line of more points than this makes the page slow to open; longer series are thinned (see _thin).
MAX_POINTS = 4000
LOW_HEADROOM_BITS = THRESHOLDS["low_headroom_bits"]
COLORS = {"line": "#1f5fa8", "skip": "#d62728", "clip": "#ff7f0e", "fwd": "#1f5fa8", "bwd": "#9467bd"}


def _layout(fig: go.Figure, *, ytitle: str, height: int = 320, **extra) -> go.Figure:
    settings = dict(template="plotly_white", height=height, margin=dict(l=70, r=30, t=20, b=45),
                    xaxis_title="step", yaxis_title=ytitle, hovermode="closest",
                    legend=dict(orientation="h", yanchor="bottom", y=1.01, x=0))
    fig.update_layout(**{**settings, **extra})
    return fig


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _thin(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """At most ``limit`` points: per bucket of consecutive points, the lowest and the highest, in order, so
    spikes and dips survive where a plain stride would drop them."""
    if len(xs) <= limit:
        return xs, ys
    size = math.ceil(len(xs) / (limit // 2))
    keep: list[int] = []
    for start in range(0, len(xs), size):
        idx = range(start, min(start + size, len(xs)))
        lo, hi = min(idx, key=ys.__getitem__), max(idx, key=ys.__getitem__)
        keep += sorted({lo, hi})
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _stride(points: list, limit: int = MAX_POINTS) -> list:
    # Markers (skipped, clipped steps) are thinned evenly: a run that skips every step still opens.
    return points if len(points) <= limit else points[:: math.ceil(len(points) / limit)]


def loss_figure(data: TraceData) -> go.Figure | None:
    """Loss per step; skipped steps marked on the line (at the last finite loss before them)."""
    rows = [r for r in data.steps if _finite(r.loss)]
    if not rows:
        return None
    xs, ys = _thin([r.step for r in rows], [r.loss for r in rows])
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines", name="loss", line=dict(color=COLORS["line"], width=1.5)))
    skipped = set(data.skipped_steps)
    marks, last = [], None
    for r in data.steps:
        if _finite(r.loss):
            last = r.loss
        if r.step in skipped and last is not None:
            marks.append((r.step, last))
    marks = _stride(marks)
    if marks:
        fig.add_trace(go.Scatter(x=[s for s, _ in marks], y=[v for _, v in marks], mode="markers",
                                 name="skipped step", marker=dict(symbol="x", size=9, color=COLORS["skip"])))
    losses = [r.loss for r in rows]
    # A loss that falls by orders of magnitude reads better on a log axis.
    log = min(losses) > 0 and max(losses) / min(losses) > 100
    return _layout(fig, ytitle="loss", yaxis_type="log" if log else "linear")


def scale_figure(data: TraceData) -> go.Figure | None:
    """log2 of the loss scale per step, drawn as steps; skipped steps as red crosses at the scale they used."""
    rows = [r for r in data.steps if r.scale is not None]
    if not rows:
        return None
    xs, ys = _thin([r.step for r in rows], [math.log2(r.scale) for r in rows])
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines", line=dict(shape="hv", color=COLORS["line"], width=1.5),
                               name="log2 scale"))
    by_step = {r.step: r.scale for r in rows}
    skips = [s for s in data.skipped_steps if s in by_step]
    if skips:
        shown = _stride(skips)
        fig.add_trace(go.Scatter(x=shown, y=[math.log2(by_step[s]) for s in shown], mode="markers",
                                 name=f"skipped step ({len(skips)})",
                                 marker=dict(symbol="x", size=10, color=COLORS["skip"])))
    first = next((e for e in data.nonfinite if e["step"] is not None and not e.get("scaled_only")), None)
    if first is not None:
        module = "?" if first["module"] is None else (first["module"] or "<top>")
        fig.add_vline(x=first["step"], line=dict(color="#555", dash="dot"),
                      annotation_text=f"first non-finite: {module}", annotation_position="top right",
                      annotation_font_size=11)
    return _layout(fig, ytitle="log2 loss scale", yaxis=dict(dtick=1), margin=dict(l=70, r=30, t=30, b=45))


def grad_figure(data: TraceData) -> go.Figure | None:
    """Gradient norm (before clipping, log axis); clipped steps in orange, non-finite norms as red ticks on top."""
    rows = [r for r in data.steps if _finite(r.grad_norm) and r.grad_norm > 0]
    if not rows:
        return None
    xs, ys = _thin([r.step for r in rows], [r.grad_norm for r in rows])
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines", name="grad norm",
                               line=dict(color=COLORS["line"], width=1.2)))
    clipped = [r for r in rows if r.clipped]
    if clipped:
        shown = _stride(clipped)
        fig.add_trace(go.Scatter(x=[r.step for r in shown], y=[r.grad_norm for r in shown], mode="markers",
                                 name=f"clipped ({len(clipped)})", marker=dict(size=6, color=COLORS["clip"])))
    bad = [r.step for r in data.steps if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    if bad:
        top = max(r.grad_norm for r in rows)
        fig.add_trace(go.Scatter(x=_stride(bad), y=[top * 1.5] * len(_stride(bad)), mode="markers",
                                 name=f"non-finite ({len(bad)})",
                                 marker=dict(symbol="triangle-down", size=9, color=COLORS["skip"])))
    return _layout(fig, ytitle="gradient norm", yaxis=dict(type="log", **_log_ticks([r.grad_norm for r in rows])))


def _log_ticks(values: list[float]) -> dict:
    # Ticks at 1, 2, 5 per decade, labelled in full: plotly's own minor labels on a log axis are bare digits
    # ("5" for 0.5), which read wrong when a norm spans one or two decades.
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values) * 1.5))
    steps = (1, 2, 5) if hi - lo <= 4 else (1,)  # many decades: one tick each, or the labels collide
    ticks = [m * 10.0 ** e for e in range(lo, hi + 1) for m in steps]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


def divergence_figure(data: TraceData) -> go.Figure | None:
    """Heatmap of log10 rel_l2 vs FP32: one row per module (worst at the top), one column per sampled step."""
    scope = data.divergence_scope()
    if scope is None:
        return None
    tables = divergence_table(data, threshold=math.inf)
    # The culprits first, as the report's table ranks them (ampaudit.runtime.attribution), then the rest.
    ranked = rank_by_verdict(tables[scope], divergence_culprits(data, tables, scope))[:MAX_MODULES]
    modules = [r["module"] for r in ranked]
    flagged = {r["module"]: r["verdict"] for r in ranked if r.get("verdict")}
    steps = sorted({d["step"] for d in data.divergence if d["scope"] == scope and d["step"] is not None})
    if not modules or not steps:
        return None
    col = {s: i for i, s in enumerate(steps)}
    row = {m: i for i, m in enumerate(modules)}
    z: list[list[float | None]] = [[None] * len(steps) for _ in modules]
    text: list[list[str]] = [[""] * len(steps) for _ in modules]
    for d in data.divergence:
        i, j, v = row.get(d["module"]), col.get(d["step"]), d["rel_l2"]
        if d["scope"] != scope or i is None or j is None or v is None:
            continue
        # NaN and inf show as the worst colour; exact zeros as the best.
        z[i][j] = 2.0 if not math.isfinite(v) else math.log10(max(v, 1e-12))
        text[i][j] = f"{v:.3g}"
    if all(v is None for zrow in z for v in zrow):
        return None
    fig = go.Figure(go.Heatmap(
        z=z, x=steps, y=[(m or "<top>") + (f" (culprit #{flagged[m]['rank']})" if m in flagged else "")
                         for m in modules], text=text, colorscale="YlOrRd", zmin=-4, zmax=0,
        hovertemplate="step %{x}<br>%{y}<br>rel_l2 %{text}<extra></extra>",
        colorbar=dict(title=dict(text="log10 rel_l2"), tickvals=[-4, -3, -2, -1, 0],
                      ticktext=["1e-4", "1e-3", "0.01", "0.1", "1"])))
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, ytitle="", height=max(260, 60 + 26 * len(modules)),
                   title=dict(text=f"{scope} rel_l2 vs FP32", x=0.0, font=dict(size=13)),
                   margin=dict(l=170, r=30, t=40, b=45))


def headroom_figure(data: TraceData) -> go.Figure | None:
    """Least headroom per module (bits below the dtype's max), forward and backward side by side."""
    rows = [r for r in headroom_table(data) if r["forward_bits"] is not None or r["backward_bits"] is not None]
    if not rows:
        return None
    rows = rows[:MAX_MODULES]
    names = [r["module"] or "<top>" for r in rows]

    def bits(r: dict, phase: str) -> float | None:
        b = r[f"{phase}_bits"]
        return None if b is None else (max(b, -1.0) if b != -math.inf else -1.0)  # -1: overflowed

    fig = go.Figure()
    for phase in ("forward", "backward"):
        vals = [bits(r, phase) for r in rows]
        if any(v is not None for v in vals):
            fig.add_trace(go.Bar(y=names, x=vals, orientation="h", name=phase,
                                 marker_color=COLORS["fwd" if phase == "forward" else "bwd"],
                                 customdata=[r[f"{phase}_step"] for r in rows],
                                 hovertemplate="%{y}<br>%{x:.2f} bits at step %{customdata}<extra>"
                                               + phase + "</extra>"))
    fig.add_vline(x=LOW_HEADROOM_BITS, line=dict(color=COLORS["skip"], dash="dash"),
                  annotation_text="low", annotation_position="top")
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, ytitle="", height=max(260, 80 + 30 * len(rows)), barmode="group",
                   legend=dict(orientation="h", yanchor="bottom", y=1.01, x=1, xanchor="right"),
                   xaxis_title="least headroom (bits below dtype max)", margin=dict(l=170, r=30, t=30, b=45))


# (div id, section title, builder, what the page says when the builder has nothing): shown in this order.
FIGURES: list[tuple[str, str, Callable[[TraceData], go.Figure | None], str]] = [
    ("plot-loss", "Loss", loss_figure, "No step events with a finite loss."),
    ("plot-eval", "Evaluation: autocast against FP32", eval_figure,
     "No eval events: the run was trained without --eval-every."),
    ("plot-scale", "Loss scale (log2) and skipped steps", scale_figure,
     "No loss scale in this run (bfloat16, or no scaler)."),
    ("plot-grad", "Gradient norm and clipping", grad_figure, "No gradient norms recorded."),
    ("plot-gradhist", "Gradient magnitudes against the dtype's range", grad_hist_figure,
     "No grad_hist events: the run was traced without tensor statistics (or before trace version 2)."),
    ("plot-precursors", "Instability precursors", precursor_figure,
     "No precursor events: the run was traced without tensor statistics (or before trace version 3)."),
    ("plot-divergence", "Divergence vs FP32 per module", divergence_figure,
     "No divergence events: the run was traced without an FP32 shadow comparison."),
    ("plot-headroom", "Headroom per module", headroom_figure,
     "No stats events: the run was traced without tensor statistics."),
]
