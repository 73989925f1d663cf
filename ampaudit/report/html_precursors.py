"""The HTML report's instability-precursor plot: the signals of the ``precursor`` events over steps, each against its
published line (rules/policy/precursors.toml), with the loss spikes marked.

    from ampaudit.report.html_precursors import precursor_figure
    fig = precursor_figure(data)   # a plotly Figure, or None when the trace holds no precursor events (version <= 2)

Panels, each where the trace has data: attention logits per module (lines at 100, 1e3, 1e4), the output logits' max
|logit| and |log Z| (the line where the run's dtype spaces logits too far apart; named after the module that made
the output, when the trace says which), and the massive-activation ratio of
the modules that came closest to it. Needs plotly, like :mod:`ampaudit.report.html_plots`, which lists it.
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ampaudit.policy import precursors as precursor_policy
from ampaudit.report.trace_precursors import _logit_limit, loss_spikes

# Lines per panel stay readable up to this many modules: the ones with the largest values are kept.
MAX_LINES = 8
PALETTE = ("#1f5fa8", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _series(data, signal: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in data.precursors:
        v = r["value"]
        if r["signal"] == signal and r["max_step"] is not None and v is not None and math.isfinite(v):
            out.setdefault(r["module"], []).append((r["max_step"], abs(v) if signal == "output_lse" else v))
    ranked = sorted(out, key=lambda m: -max(v for _, v in out[m]))
    return {m: sorted(out[m]) for m in ranked[:MAX_LINES]}


def _producer(data) -> str | None:
    return next((r["producer"] for r in reversed(data.precursors)
                 if r["signal"] in ("output_logit", "output_lse") and r.get("producer")), None)


def _panels(data) -> list[tuple[str, dict[str, list], list[tuple[float, str]]]]:
    cfg = precursor_policy()
    a, m = cfg["attn_logit"], cfg["massive_activation"]
    panels = []
    attn = _series(data, "attn_logit")
    if attn:
        panels.append(("max attention logit", attn, [(a["warning"], "warning (Kimi K2 cap)"),
                                                     (a["degradation"], "degradation"),
                                                     (a["divergence"], "divergence")]))
    made = _producer(data)     # the module that made the output, when the trace names one: what to act on
    out = {name + (f" of {made}" if made else ""): pts
           for signal, name in (("output_logit", "top |logit|"), ("output_lse", "|log Z|"))
           for pts in _series(data, signal).values()}
    if out:
        panels.append(("output logits", out, [(_logit_limit(data.meta.get("dtype")), "dtype spacing too coarse")]))
    massive = _series(data, "massive_activation")
    if massive:
        panels.append(("|x| max / median", massive, [(m["ratio"], "massive (Sun et al.)")]))
    return panels


def precursor_figure(data) -> go.Figure | None:
    panels = _panels(data)
    if not panels:
        return None
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[p[0] for p in panels])
    for i, (title, series, lines) in enumerate(panels, start=1):
        for j, (name, pts) in enumerate(series.items()):
            fig.add_trace(go.Scatter(x=[s for s, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                     name=f"{title}: {name or '<output>'}", line=dict(color=PALETTE[j % len(PALETTE)]),
                                     hovertemplate=f"{name or '<output>'}<br>step %{{x}}: %{{y:.4g}}<extra></extra>"),
                          row=i, col=1)
        for y, label in lines:
            fig.add_hline(y=y, line=dict(color="#888", dash="dash"), annotation_text=label,
                          annotation_position="top left", annotation_font_size=10, row=i, col=1)
        fig.update_yaxes(type="log", title_text=title, row=i, col=1)
    for spike in loss_spikes(data.steps)[:20]:
        fig.add_vline(x=spike["step"], line=dict(color="#d62728", dash="dot"))
    fig.update_layout(template="plotly_white", height=60 + 260 * len(panels), margin=dict(l=70, r=30, t=40, b=45),
                      hovermode="closest", legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    fig.update_xaxes(title_text="step (red dotted: loss spikes)", row=len(panels), col=1)
    return fig


__all__ = ["precursor_figure"]
