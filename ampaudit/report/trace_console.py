"""Print a trace summary (from :func:`ampaudit.report.trace_summary.summarize`) in the terminal with rich.

    from rich.console import Console
    from ampaudit.report.trace_console import render_summary
    render_summary(summarize_trace("run.jsonl"), Console())
"""
from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampaudit.report.trace_advice import THRESHOLDS
from ampaudit.report.trace_data import fmt, num
from ampaudit.report.trace_summary import probing_note

SEVERITY_STYLE = {"error": ("x", "bold red"), "warning": ("!", "yellow"), "info": ("i", "cyan")}
SHOW_SKIPPED = 12
SHOW_PROBLEMS = 10


def _pow2(value: Any) -> str:
    x = num(value)
    return "-" if x is None else f"2^{x:g}" if float(x).is_integer() else f"2^{x:.2f}"


def _run_lines(s: dict) -> list[tuple[str, str]]:
    st, loss, scale, gn = s["steps"], s["loss"], s["scale"], s["grad_norm"]
    if not st["count"]:
        return [("steps", "no step events")]
    skipped = st["skipped_steps"]
    shown = ", ".join(str(x) for x in skipped[:SHOW_SKIPPED]) + (
        f", ... (+{len(skipped) - SHOW_SKIPPED})" if len(skipped) > SHOW_SKIPPED else "")
    lines = [("steps", f"{st['count']} ({st['first']}..{st['last']}), {st['skipped']} skipped "
                       f"({fmt(st['skip_rate'], '.1%')})" + (f": {shown}" if skipped else ""))]
    loss_text = f"{fmt(loss['first'])} -> {fmt(loss['last'])} (min {fmt(loss['min'])})"
    if loss["nonfinite"]:
        loss_text += f", [red]{loss['nonfinite']} non-finite[/]"
    lines.append(("loss", loss_text))
    if scale.get("used"):
        lines.append(("loss scale", f"{_pow2(scale['min_log2'])} .. {_pow2(scale['max_log2'])} "
                                    f"(start {_pow2(scale['initial_log2'])}, final {_pow2(scale['final_log2'])}); "
                                    f"{scale['backoffs']} backoffs, {scale['growths']} growths"))
    else:
        lines.append(("loss scale", "none (no scaler in this run)"))
    grad = f"median {fmt(gn['median'])}, max {fmt(gn['max'])}; {st['clipped']} clipped steps"
    if gn["nonfinite"]:
        grad += f"; {gn['nonfinite']} non-finite"
    lines.append(("grad norm", grad))
    if s["checkpoints"]:
        lines.append(("checkpoints", f"{s['checkpoints']}, last {escape(str(s['last_checkpoint']))}"))
    if s["halt"]:
        lines.append(("halted", f"[red]at step {s['halt']['step']}: {escape(str(s['halt']['reason']))}[/]"))
    return lines


def _columns(t: Table, spec) -> None:
    """Add ``(header, justify)`` columns: names (left) fold only when a name is wider than its column; numbers
    (right) never wrap, their headers wrap at spaces instead, so an 80-column terminal loses no character and
    splits no number."""
    for col, just in spec:
        if just == "left":
            t.add_column(col, justify="left", overflow="fold")
        else:
            t.add_column(col.replace(" ", "\n"), justify="right", no_wrap=True)


def _divergence_table(div: dict) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    _columns(t, (("module", "left"), ("max rel_l2", "right"), ("at step", "right"), ("last", "right"),
                 ("min SQNR dB", "right"), (f"above {div.get('threshold', 0.05):.3g} from", "right"),
                 ("verdict", "left")))
    unjudged = {r["module"] for r in div.get("not_judged") or []}
    for r in div["top"]:
        verdict = "not judged (FP32 floor)" if r["module"] in unjudged else _verdict(r.get("verdict"))
        t.add_row(escape(r["module"] or "<top>"), fmt(r["max_rel_l2"]), str(r["max_step"] or "-"),
                  fmt(r["last_rel_l2"]), fmt(r["min_sqnr_db"], ".1f"),
                  f"step {r['drift_step']}" if r["drift_step"] is not None else "-", verdict)
    return t


def _verdict(v: dict | None) -> str:
    # The attribution's verdict (ampaudit.runtime.attribution): which line the module's own error crossed.
    if not v:
        return "-"
    style = "red" if v["severity"] == "error" else "yellow"
    what = {"nonfinite": "inf/NaN", "absolute": f"{fmt(v['units'], '.0f')} u",
            "relative": f"{fmt(v['ratio'], '.0f')}x the model's median"}.get(v["rule"], v["rule"])
    return f"[{style}]culprit #{v['rank']}[/]: {what}"


def _headroom_table(hr: dict) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    _columns(t, (("module", "left"), ("forward bits", "right"), ("at step", "right"), ("backward bits", "right"),
                 ("max |x|", "right"), ("inf/nan", "right"), ("> max", "right"), ("subnormal", "right")))
    for r in hr["top"]:
        fwd = fmt(r["forward_bits"], ".2f")
        low = num(r["forward_bits"]) is not None and num(r["forward_bits"]) < THRESHOLDS["low_headroom_bits"]
        t.add_row(escape(r["module"] or "<top>"), f"[red]{fwd}[/]" if low else fwd,
                  str(r["forward_step"] if r["forward_step"] is not None else "-"),
                  fmt(r["backward_bits"], ".2f"), fmt(r["max_absmax"], ".4g"), f"{r['inf']}/{r['nan']}",
                  str(r.get("overflow", 0)),
                  fmt(r["subnormal_frac"], ".2%"))
    return t


def _fp8_table(layers: list[dict]) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    _columns(t, (("module", "left"), ("at step", "right"), ("input amax", "right"), ("input flushed", "right"),
                 ("grad_output amax", "right"), ("grad_output flushed", "right"), ("clipped", "right")))
    for r in layers:
        inp, go = r.get("input") or {}, r.get("grad_output") or {}
        clipped = max((num((r.get(role) or {}).get("clipped_share")) or 0.0 for role in ("input", "weight",
                                                                                         "grad_output")))
        t.add_row(escape(r["module"] or "<top>"), str(r["step"] if r["step"] is not None else "-"),
                  fmt(inp.get("amax"), ".4g"), fmt(inp.get("flushed_share"), ".1%"),
                  fmt(go.get("amax"), ".4g"), fmt(go.get("flushed_share"), ".1%"), fmt(clipped, ".1%"))
    return t


def _render_fp8(fp8: dict, c: Console) -> None:
    c.print(f"\n[bold]Float8 layers[/] (latest cast statistics, {len(fp8['layers'])} layers)")
    if fp8["layers"]:
        c.print(_fp8_table(fp8["layers"]))
    for b in fp8["budget"]:
        then = "; now trains in bf16" if b.get("fallback") else ""
        c.print(f"  [yellow]![/] step {b['step']}: {fmt(b['flushed_share'], '.0%')} of "
                f"[bold]{escape(b['module'] or '<top>')}[/]'s {escape(str(b['role']))} flushes to 0 in fp8 (budget "
                f"{fmt(b['max_flushed_share'], '.0%')}){then}")


def _render_precursors(prec: dict, c: Console) -> None:
    # Every attention and output row; massive activations only where they crossed (one row per module otherwise).
    rows = [r for r in prec["signals"] if r["signal"] != "massive_activation" or r["crossed_step"] is not None]
    c.print(f"\n[bold]Instability precursors[/] (rules/policy/precursors.toml)")
    if rows:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        _columns(t, (("signal", "left"), ("module", "left"), ("max", "right"), ("at step", "right"),
                     ("line", "right"), ("crossed at", "right")))
        for r in rows:
            crossed = r["crossed_step"]
            where = r["module"] or (f"{r['producer']} (the output)" if r.get("producer") else "<output>")
            t.add_row(r["signal"], escape(where), fmt(r["max"], ".4g"),
                      str(r["max_step"] if r["max_step"] is not None else "-"), fmt(r["threshold"], ".4g"),
                      f"[red]step {crossed}[/]" if crossed is not None else "-")
        c.print(t)
    spikes = prec.get("spikes") or {}
    if spikes.get("count"):
        first = spikes["first"]
        c.print(f"  loss spikes ({fmt(spikes['sigmas'], 'g')} sigma above the rolling mean): {spikes['count']}, "
                f"first at step {first['step']} ({fmt(first['loss'], '.4g')}, {fmt(first['sigmas'], '.1f')} sigma)")


def _render_header(summary: dict, meta: dict, c: Console) -> None:
    """The trace's name and run, its problems (unreadable lines, unknown events), then the run's lines."""
    about = " / ".join(str(meta[k]) for k in ("source", "dtype", "device", "model") if meta.get(k))
    c.print(f"[bold]ampaudit report[/] {escape(str(summary.get('trace') or ''))}"
            + (f"  [dim]({escape(about)})[/]" if about else ""))
    shown = summary["problems"][:SHOW_PROBLEMS]
    for p in shown:
        c.print(f"[yellow]trace problem:[/] {escape(p)}")
    hidden = summary.get("problems_total", len(shown)) - len(shown)
    if hidden > 0:
        c.print(f"[yellow]trace problem:[/] ... and {hidden} more unreadable lines")
    if summary.get("unknown_events"):
        kinds = ", ".join(f"{k} x{n}" for k, n in summary["unknown_events"].items())
        c.print(f"[dim]ignored unknown events: {escape(kinds)}[/]")

    c.print()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, text in _run_lines(summary):
        grid.add_row(label, text)
    if summary.get("grad_hist"):            # histograms of log2|gradient|: ampaudit.report.grad_hist
        from ampaudit.report.grad_hist import describe
        grid.add_row("grad range", escape(describe(summary["grad_hist"])))
    c.print(grid)


def _render_first_nonfinite(summary: dict, c: Console) -> None:
    first = summary["first_nonfinite"]
    c.print("\n[bold]First non-finite[/]")
    if first:
        where = f" at [bold]{escape(first['source'])}[/]" if first.get("source") else ""
        module = first.get("module")
        module = "?" if module is None else (module or "<top>")
        c.print(f"  step {first['step']}: [red]{first.get('kind') or 'non-finite'}[/] in "
                f"{first.get('phase') or '?'} of [bold]{escape(module)}[/] ({escape(first.get('op') or '?')}){where}"
                + (f"; {summary['nonfinite']['count']} non-finite events in all"
                   if summary["nonfinite"]["count"] > 1 else ""))
    else:
        note = probing_note(summary["nonfinite"].get("scaled_only", 0))
        c.print("  none recorded" + (f" ({note})" if note else ""))


def _render_recommendations(summary: dict, c: Console) -> None:
    c.print("\n[bold]Recommendations[/]")
    if not summary["recommendations"]:
        c.print("  none: the run looks healthy" if summary["steps"]["count"] else "  none: the trace holds no steps")
    for rec in summary["recommendations"]:
        mark, style = SEVERITY_STYLE.get(rec["severity"], ("-", ""))
        c.print(f"  [{style}]{mark}[/] {escape(rec['message'])}")
        if rec.get("code"):
            c.print(f"      [green]{escape(rec['code'])}[/]")
        for f in rec.get("findings", [])[:10]:
            c.print(f"      {escape(str(f['rule']))} {escape(f['module'] or '<top>')}: "
                    f"{escape(str(f['message']))} [dim](run: {escape(f['evidence'])})[/]")


def render_summary(summary: dict, console: Console | None = None) -> None:
    """Print every section of the summary that has data; problems with the trace come first."""
    c = console or Console()
    meta = summary.get("meta") or {}
    _render_header(summary, meta, c)
    _render_first_nonfinite(summary, c)

    div = summary["divergence"]
    if div["top"]:
        c.print(f"\n[bold]Divergence vs FP32[/] ({div['scope']}, worst {len(div['top'])} of {div['modules']})")
        c.print(_divergence_table(div))
        jump = div.get("first_jump")
        if jump:
            what = "own error" if div["scope"] == "local" else f"{div['scope']} error"
            c.print(f"  the error first shows at [bold]{escape(jump['module'] or '<top>')}[/] (step {jump['step']}, "
                    f"{what} {fmt(jump['rel_l2'], '.3g')}, past its {escape(str(jump.get('rule') or 'line'))} line)")
        unjudged = div.get("not_judged") or []
        if unjudged:
            names = ", ".join(escape(r["module"] or "<top>") for r in unjudged[:3])
            more = f" and {len(unjudged) - 3} more" if len(unjudged) > 3 else ""
            worst = max(r["fp32_moved"] for r in unjudged)
            c.print(f"  not judged: {names}{more}: moving their FP32 inputs one unit in the last place moves their "
                    f"FP32 output by up to {fmt(worst, '.3g')} (relative L2), so FP32 does not determine it either")
    hr = summary["headroom"]
    if hr["top"]:
        dtype = meta.get("dtype") or "dtype"
        c.print(f"\n[bold]Headroom[/] (bits below the {escape(str(dtype))} max; least first, "
                f"{len(hr['top'])} of {hr['modules']})")
        c.print(_headroom_table(hr))

    fp8 = summary.get("fp8") or {}
    if fp8.get("layers") or fp8.get("budget"):
        _render_fp8(fp8, c)
    recipes = summary.get("recipes") or {}
    if recipes.get("layers") or recipes.get("fallbacks"):
        from ampaudit.report.trace_recipes import render_recipes
        render_recipes(recipes, c)

    if (summary.get("eval") or {}).get("count"):
        from ampaudit.report.trace_eval import render_eval
        render_eval(summary["eval"], c)

    if (summary.get("swamping") or {}).get("tensors") or (summary.get("swamping") or {}).get("overflows"):
        from ampaudit.report.trace_swamping import render_swamping
        render_swamping(summary["swamping"], c)
    if (summary.get("decisions") or {}).get("sites"):
        from ampaudit.report.trace_decisions import render_decisions
        render_decisions(summary["decisions"], c)
    prec = summary.get("precursors") or {}
    if prec.get("signals") or (prec.get("spikes") or {}).get("count"):
        _render_precursors(prec, c)

    _render_recommendations(summary, c)
