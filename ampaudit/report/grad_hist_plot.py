"""The HTML report's gradient-magnitude plot: the classic picture of why loss scaling exists.

    from ampaudit.report.grad_hist_plot import grad_hist_figure
    fig = grad_hist_figure(data)     # a plotly Figure, or None when the trace has no grad_hist events

Bars: the share of the run's nonzero activation gradients per ``floor(log2|g|)``, without loss scaling and with
the run's loss scale (or, for a run without one, the suggested initial scale), over the dtype's range: the band
that rounds to zero, the subnormal band, the normal range and the overflow above it. Needs plotly.
"""
from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from ampaudit.report.grad_hist import describe, grad_hist_summary, run_histograms
from ampaudit.report.trace_data import TraceData

COLORS = {"unscaled": "#ff7f0e", "scaled": "#1f5fa8", "flush": "rgba(214,39,40,0.16)",
          "subnormal": "rgba(255,193,7,0.22)", "overflow": "rgba(214,39,40,0.16)"}
# A band of the dtype is drawn when it lies within this many bits of the gradients (bf16's subnormals, 100 bits
# below any gradient, would squeeze the bars into a sliver).
NEAR_BITS = 32


def _wrap(text: str, width: int = 120) -> str:
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False))


def grad_hist_figure(data: TraceData) -> go.Figure | None:
    """Histogram of log2|gradient| against the dtype's range (see the module docstring); None without data."""
    if not data.grad_hist:
        return None
    h = run_histograms(data)
    g = grad_hist_summary(data, hists=h)
    if not g or not g["unscaled"]["values"]:
        return None
    unscaled = h["unscaled"]
    if g["scaled_run"]:
        shifted, label = h["measured"], f"with the run's loss scale (2^{g['scale_log2']})"
    else:
        k = g["init_scale_log2"] or 0
        shifted, label = {e + k: n for e, n in unscaled.items()}, f"with the suggested scale 2^{k}"
    total = sum(unscaled.values())
    fig = go.Figure()
    for name, hist, color in (("without loss scaling", unscaled, COLORS["unscaled"]),
                              (label, shifted, COLORS["scaled"])):
        xs = sorted(hist)
        # Bin e holds [2^e, 2^(e+1)): its bar spans e..e+1 on the log2 axis.
        fig.add_trace(go.Bar(x=[e + 0.5 for e in xs], y=[hist[e] / total for e in xs], name=name,
                             customdata=xs, marker_color=color, opacity=0.75, width=0.9,
                             hovertemplate="|g| in [2^%{customdata}, 2x): %{y:.2%}<extra>" + name + "</extra>"))
    lo = min(min(unscaled), min(shifted))
    hi = max(max(unscaled), max(shifted))
    cut, normal, top = g["min_subnormal_log2"] - 1, g["min_normal_log2"], g["max_log2"] + 1
    # The bands near the gradients are shown at least 3 bits wide, so they can be seen and read.
    left = (min(lo, cut - 3) if cut >= lo - NEAR_BITS else lo) - 1
    right = (max(hi + 1, top + 3) if top <= hi + NEAR_BITS else hi + 1) + 1
    sub = g["min_subnormal_log2"]
    bands = [(left, cut, COLORS["flush"], f"rounds to 0 (< 2^{cut})"),
             (cut, normal, COLORS["subnormal"], f"subnormal (2^{sub} is the smallest)"),
             (normal, top, "rgba(0,0,0,0)", f"normal (from 2^{normal})"),
             (top, right, COLORS["overflow"], f"overflow (from 2^{top})")]
    for x0, x1, color, text in bands:
        x0, x1 = max(x0, left), min(x1, right)
        if x1 - x0 >= 2:            # a sliver at the edge of the axis gets neither fill nor label
            fig.add_vrect(x0=x0, x1=x1, fillcolor=color, line_width=0, layer="below",
                          annotation_text=text, annotation_position="top left", annotation_font_size=11)
    for x in (sub, normal, top):
        if left < x < right:
            fig.add_vline(x=x, line=dict(color="#555", dash="dot", width=1))
    fig.update_layout(template="plotly_white", height=380, barmode="overlay", bargap=0.05, hovermode="closest",
                      margin=dict(l=70, r=30, t=70, b=45), xaxis_title="log2 |activation gradient|",
                      yaxis_title="share of nonzero values", yaxis_tickformat=".0%",
                      xaxis=dict(range=[left, right], dtick=4 if right - left <= 80 else 16),
                      title=dict(text=_wrap(describe(g)), x=0.0, font=dict(size=12)),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=1, xanchor="right"))
    return fig
