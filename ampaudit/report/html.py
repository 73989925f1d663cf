"""One self-contained HTML page for a trace: the summary, the recommendations and the plotly plots of
:data:`ampaudit.report.html_plots.FIGURES`.

    from ampaudit.report.html import write_html
    events, problems = read_trace("run.jsonl")
    write_html("run.html", events, problems, trace="run.jsonl")   # or build_html(...) -> str

plotly.js is embedded inline, so the page opens without a network. Needs plotly (``pip install 'ampaudit[report]'``);
without it :func:`require_plotly` raises a :class:`~ampaudit.errors.UsageError` that says so.
"""
from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Iterable

from ampaudit.errors import UsageError
from ampaudit.fileio import atomic_write_text
from ampaudit.report.trace_data import TraceData, fmt
from ampaudit.report.trace_summary import collect, probing_note, summarize

PLOTLY_HINT = "pip install 'ampaudit[report]'"

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1300px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 2px; } h2 { font-size: 17px; margin: 28px 0 6px; }
.sub { color: #666; margin-bottom: 16px; }
table.facts td { padding: 2px 14px 2px 0; vertical-align: top; } table.facts td:first-child { font-weight: 600; }
.problem { background: #fff4d6; border-left: 4px solid #e0a800; padding: 6px 10px; margin: 4px 0; }
.rec { padding: 6px 10px; margin: 6px 0; border-left: 4px solid #888; background: #f6f7f9; }
.rec.error { border-color: #d62728; } .rec.warning { border-color: #ff7f0e; } .rec.info { border-color: #1f77b4; }
code { background: #eef0f3; padding: 1px 4px; border-radius: 3px; }
.empty { color: #888; font-style: italic; }
.plot { min-height: 200px; }
"""


def require_plotly():
    """Import plotly or raise the one-line error that names the extra to install."""
    try:
        import plotly.offline  # noqa: F401
        from ampaudit.report import html_plots
    except ImportError:
        raise UsageError("--html needs plotly, which is not installed", hint=PLOTLY_HINT) from None
    return html_plots


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _facts(s: dict) -> str:
    st, scale, loss, gn = s["steps"], s["scale"], s["loss"], s["grad_norm"]
    rows = [("steps", f"{st['count']}" + (f" ({st['first']}..{st['last']})" if st["count"] else "")),
            ("skipped", f"{st['skipped']} ({fmt(st['skip_rate'], '.1%')})")]
    if scale.get("used"):
        rows.append(("loss scale", f"2^{fmt(scale['min_log2'], 'g')} .. 2^{fmt(scale['max_log2'], 'g')}, "
                                   f"final 2^{fmt(scale['final_log2'], 'g')}; {scale['backoffs']} backoffs"))
    rows.append(("loss", f"{fmt(loss['first'])} &rarr; {fmt(loss['last'])} (min {fmt(loss['min'])})"))
    rows.append(("grad norm", f"median {fmt(gn['median'])}, max {fmt(gn['max'])}; {st['clipped']} clipped"))
    if s.get("grad_hist"):
        from ampaudit.report.grad_hist import describe
        rows.append(("grad range", _e(describe(s["grad_hist"]))))
    first = s["first_nonfinite"]
    if first:
        where = f" at <code>{_e(first['source'])}</code>" if first.get("source") else ""
        module = "?" if first.get("module") is None else (first["module"] or "<top>")
        rows.append(("first non-finite", f"step {_e(first['step'])}: {_e(first.get('kind') or 'non-finite')} in "
                                         f"{_e(first.get('phase') or '?')} of <b>{_e(module)}</b> "
                                         f"({_e(first.get('op') or '?')}){where}"))
    elif probing_note(s["nonfinite"].get("scaled_only", 0)):
        rows.append(("first non-finite", "none recorded (" + _e(probing_note(s["nonfinite"]["scaled_only"])) + ")"))
    if (s.get("eval") or {}).get("count"):
        rows.append(("eval", _eval_fact(s["eval"])))
    tensors = (s.get("swamping") or {}).get("tensors") or []
    if tensors:
        rows.append(("swamping", "; ".join(
            f"<b>{_e(r['tensor'])}</b> ({_e(r['dtype'] or '?')}): {fmt(r['share_rounded'], '.0%')} of updates "
            f"rounded away, {fmt(r['realized_ratio'], '.0%')} of the FP32 movement kept" for r in tensors[:5])
            + (f"; {len(tensors) - 5} more" if len(tensors) > 5 else "")))
    for r in (s.get("swamping") or {}).get("overflows") or []:
        rows.append(("state overflow", f"<b>{_e(r['tensor'])}</b> ({_e(r['dtype'] or '?')}): FP32 updates reach "
                                       f"{fmt(r['fp32_absmax'])}, beyond {fmt(r['limit'], '.6g')}"))
    if (s.get("decisions") or {}).get("sites"):
        dec = s["decisions"]
        flipped = "; ".join(f"<b>{_e(r['module'] or '<top>')}</b> {_e(r['op'])} {fmt(r['share_flipped'], '.1%')} "
                            f"flipped (step {_e(r['step'])})" for r in dec["flagged"][:4])
        rows.append(("decisions", f"{dec['sites']} site(s) against FP32" + (f": {flipped}" if flipped else
                                                                              ", none flipped beyond noise")))
    if s["halt"]:
        rows.append(("halted", f"step {_e(s['halt']['step'])}: {_e(s['halt']['reason'])}"))
    # Values above are numbers or escaped already; labels are fixed strings.
    return "<table class=facts>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _eval_fact(ev: dict) -> str:
    last = ev["last"]
    parts = [f"{_e(name)} {fmt(q['autocast'], '.4g')} | {fmt(q['fp32'], '.4g')}"
             for name, q in list(last["quantities"].items())[:4]]
    return (f"{ev['count']} evals, {_e(ev.get('dtype') or '?')} autocast | FP32 at step {_e(last['step'])}: "
            + ", ".join(parts) + f"; {len({b['step'] for b in ev['beyond_noise']})} beyond noise")


def _recommendations(s: dict) -> str:
    if not s["recommendations"]:
        return "<p class=empty>None: the run looks healthy.</p>" if s["steps"]["count"] else \
            "<p class=empty>None: the trace holds no steps.</p>"
    parts = []
    for rec in s["recommendations"]:
        body = _e(rec["message"])
        if rec.get("code"):
            body += f"<br><code>{_e(rec['code'])}</code>"
        for f in rec.get("findings", [])[:20]:
            body += (f"<br>&middot; <b>{_e(f['rule'])}</b> {_e(f['module'] or '<top>')}: {_e(f['message'])} "
                     f"<i>(run: {_e(f['evidence'])})</i>")
        parts.append(f"<div class='rec {_e(rec['severity'])}'>{body}</div>")
    return "".join(parts)


def build_html(events: Iterable[dict] | TraceData, problems: Iterable[str] = (), *, trace: str | None = None,
               summary: dict | None = None, findings: list[dict] | None = None) -> str:
    """The page as a string. ``summary`` may be passed when already computed from the same events."""
    plots = require_plotly()
    import plotly.offline

    data = events if isinstance(events, TraceData) else collect(events)
    problems = list(problems)
    s = summary or summarize(data, problems, findings=findings, trace=trace)
    meta = s.get("meta") or {}
    about = " / ".join(str(meta[k]) for k in ("source", "dtype", "device", "model") if meta.get(k))
    title = f"ampaudit report: {Path(trace).name}" if trace else "ampaudit report"
    out = ["<!DOCTYPE html><html lang=en><head><meta charset='utf-8'>",
           f"<title>{_e(title)}</title><style>{CSS}</style>",
           f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head><body>",
           f"<h1>{_e(title)}</h1><div class=sub>{_e(about)}</div>"]
    out += [f"<div class=problem>trace problem: {_e(p)}</div>" for p in s["problems"]]
    if s.get("problems_total", 0) > len(s["problems"]):
        out.append(f"<div class=problem>... and {s['problems_total'] - len(s['problems'])} more</div>")
    out += ["<h2>Run</h2>", _facts(s), "<h2>Recommendations</h2>", _recommendations(s)]
    config = {"displaylogo": False, "responsive": True}
    for div_id, heading, build, empty_text in plots.FIGURES:
        out.append(f"<h2>{_e(heading)}</h2>")
        fig = build(data)
        if fig is None:
            out.append(f"<p class=empty id='{div_id}-empty'>{_e(empty_text)}</p>")
            continue
        out.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=config,
                               default_width="100%"))
    # The summary rides along for tools; "</" escaped so a module name cannot close the script element.
    embedded = json.dumps(s).replace("</", "<\\/")
    out.append(f"<script type='application/json' id='ampaudit-summary'>{embedded}</script>")
    out.append("</body></html>")
    return "\n".join(out)


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write the page atomically (see :mod:`ampaudit.fileio`); an unwritable path is a one-line UsageError."""
    return atomic_write_text(path, text, hint="choose a writable path for --html")


def write_html(path: str | os.PathLike, events: Iterable[dict] | TraceData, problems: Iterable[str] = (), *,
               trace: str | None = None, summary: dict | None = None,
               findings: list[dict] | None = None) -> Path:
    """Build the page and write it atomically to ``path``; returns the path."""
    return write_atomic(path, build_html(events, problems, trace=trace, summary=summary, findings=findings))
