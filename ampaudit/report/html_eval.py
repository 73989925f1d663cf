"""The HTML report's evaluation plot: per quantity (loss, then each metric), the autocast and the FP32 value of every
``eval`` event, the FP32 value's noise band (+-noise_sigmas standard errors) and the evals whose gap is beyond it.

    from ampaudit.report.html_eval import eval_figure
    fig = eval_figure(data)      # a plotly Figure, or None when the trace holds no eval events

Needs plotly, like :mod:`ampaudit.report.html_plots`, which lists it among its figures.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ampaudit.report.trace_eval import judge, thresholds

MAX_QUANTITIES = 6        # the loss and the first five metrics
COLORS = {"autocast": "#d62728", "fp32": "#1f5fa8", "band": "rgba(31,95,168,0.15)"}


def eval_figure(data) -> go.Figure | None:
    rows = [r for r in data.evals if r["step"] is not None and r["quantities"]]
    if not rows:
        return None
    names: list[str] = []
    for r in rows:
        names += [n for n in r["quantities"] if n not in names]
    names = names[:MAX_QUANTITIES]
    limits = thresholds()
    legend_beyond = True
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=names)
    for i, name in enumerate(names, start=1):
        pts = [(r["step"], r["quantities"][name]) for r in rows if name in r["quantities"]]
        steps = [s for s, _ in pts]
        fp32 = [q["fp32"] for _, q in pts]
        band = [limits["noise_sigmas"] * q["noise"] if q["noise"] is not None else None for _, q in pts]
        if any(b is not None for b in band):
            hi = [f + b if f is not None and b is not None else None for f, b in zip(fp32, band)]
            lo = [f - b if f is not None and b is not None else None for f, b in zip(fp32, band)]
            fig.add_trace(go.Scatter(x=steps, y=hi, mode="lines", line=dict(width=0), hoverinfo="skip",
                                     showlegend=False), row=i, col=1)
            fig.add_trace(go.Scatter(x=steps, y=lo, mode="lines", line=dict(width=0), fill="tonexty",
                                     fillcolor=COLORS["band"], hoverinfo="skip", name="FP32 noise",
                                     showlegend=i == 1), row=i, col=1)
        for which, dash in (("fp32", "dash"), ("autocast", "solid")):
            fig.add_trace(go.Scatter(
                x=steps, y=[q[which] for _, q in pts], mode="lines+markers", name=which, legendgroup=which,
                showlegend=i == 1, line=dict(color=COLORS[which], dash=dash),
                customdata=[q["gap"] for _, q in pts],
                hovertemplate=f"{name} {which}: %{{y:.5g}}<br>step %{{x}}, gap %{{customdata:+.3g}}<extra></extra>"),
                row=i, col=1)
        beyond = [(s, q["autocast"]) for s, q in pts if judge(q, limits) is not None and q["autocast"] is not None]
        if beyond:
            fig.add_trace(go.Scatter(x=[s for s, _ in beyond], y=[v for _, v in beyond], mode="markers",
                                     marker=dict(symbol="x", size=11, color=COLORS["autocast"]),
                                     name="gap beyond noise", legendgroup="beyond", showlegend=legend_beyond,
                                     hovertemplate="gap beyond noise at step %{x}<extra></extra>"), row=i, col=1)
            legend_beyond = False
    fig.update_layout(template="plotly_white", height=80 + 220 * len(names), margin=dict(l=70, r=30, t=40, b=45),
                      hovermode="closest", legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    return fig


__all__ = ["eval_figure"]
