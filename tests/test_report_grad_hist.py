"""The gradient-magnitude section of `ampaudit report` (ampaudit/report/grad_hist.py, grad_hist_plot.py): shares that
flush or go subnormal with and without loss scaling, the initial scale, the console line, and the plot as headless
Chromium draws it (skipped where Chromium is absent, like tests/test_report_html.py whose helpers it uses)."""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

from ampaudit.report.grad_hist import dtype_range, fit_scale, shares
from ampaudit.report.trace_summary import collect, summarize, summarize_trace
from ampaudit.runtime.trace import read_trace
from ampaudit.runtime.watch import watch

from conftest import ASSETS, load_planted
from trace_events import ev


def _run(trace, *, steps: int = 20, scaled: bool = True) -> None:
    """tiny_grads under fp16 autocast in a plain loop, watched, with or without torch's GradScaler."""
    planted = load_planted("tiny_grads")
    model = planted.build_model()
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, trace=trace, every=5, scaler=scaler) as w:
        for step, (x, y) in enumerate(itertools.islice(planted.train_data(), steps)):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = planted.loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()


@pytest.fixture(scope="module")
def scaled_trace(tmp_path_factory):
    trace = tmp_path_factory.mktemp("gh") / "tiny_grads.jsonl"
    _run(trace)
    return trace


@pytest.mark.slow
def test_tiny_grads_flush_without_scaling_and_fit_with_it(scaled_trace):
    g = summarize_trace(scaled_trace)["grad_hist"]
    assert (g["dtype"], g["min_subnormal_log2"], g["min_normal_log2"], g["max_log2"]) == ("float16", -24, -14, 15)
    assert g["scale_log2"] == 16 and g["scale_source"] == "trace" and g["scaled_run"]
    # Without scaling: (nearly) every gradient lies below half fp16's smallest subnormal, so it would round to 0.
    assert g["unscaled"]["max_log2"] < -24 and g["unscaled"]["flushed_share"] > 0.999
    # With the run's 2^16: none below the smallest subnormal, most in the subnormal range, none overflowing.
    s = g["scaled"]
    assert s["min_log2"] >= -24 and s["flushed_share"] == 0 and s["subnormal_share"] > 0.5 and s["max_log2"] < 0
    # The initial scale lifts all but 0.1% above the smallest normal, so it is more than the 2^16 of the run.
    assert g["fits"] and g["init_scale_log2"] == g["needed_log2"] > 16
    assert g["init_scale_log2"] + g["unscaled"]["max_log2"] < 15
    rec = next(r for r in summarize_trace(scaled_trace)["recommendations"] if r["kind"] == "grad_scale")
    assert f"start it at 2^{g['init_scale_log2']}" in rec["message"]
    assert rec["code"] == f"torch.amp.GradScaler('cpu', init_scale={2.0 ** g['init_scale_log2']!r})"


@pytest.mark.slow
def test_console_has_the_grad_range_line(scaled_trace):
    out = subprocess.run([sys.executable, "-m", "ampaudit", "report", str(scaled_trace)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    line = re.sub(r"\s+", " ", out.stdout[out.stdout.index("grad range"):out.stdout.index("First non-finite")])
    assert "without loss scaling 100% of activation gradients flush to 0 in float16" in line
    assert "at the run's loss scale 2^16: 0% flush" in line


def test_an_unscaled_fp16_run_shows_zeros_and_says_why(tmp_path):
    trace = tmp_path / "plain.jsonl"
    _run(trace, steps=5, scaled=False)
    g = summarize_trace(trace)["grad_hist"]
    # The hooks see fp16 gradients that flushed already: zeros, not tiny values; the scale is unknown.
    assert g["zeros_share"] == 1.0 and g["unscaled"]["values"] == 0 and g["scale_source"] == "unknown"
    from ampaudit.report.grad_hist import describe
    assert "those include gradients flushed already" in describe(g) and "pass scaler=" in describe(g)


def test_trainer_traces_carry_the_scale_of_each_step(tmp_path):
    from ampaudit.train import Trainer

    planted = load_planted("tiny_grads")
    found = {}
    for mode in ("dynamic", "none"):
        trace = tmp_path / f"{mode}.jsonl"
        Trainer(planted.build_model(), planted.loss_fn, planted.train_data, dtype="float16", loss_scale=mode,
                lr=1e-3, trace=trace).fit(steps=3)
        events, _ = read_trace(trace)
        found[mode] = ({e["scale"] for e in events if e["event"] == "grad_hist"}, summarize(events)["grad_hist"])
    assert found["dynamic"][0] == {65536.0} and found["none"][0] == {1.0}   # no scaler: the session says 1
    assert found["dynamic"][1]["unscaled"]["flushed_share"] > 0.999 and found["dynamic"][1]["scaled_run"]
    assert found["none"][1]["zeros_share"] == 1.0 and not found["none"][1]["scaled_run"]


def test_scale_comes_from_step_events_when_the_histogram_has_none():
    events = [ev("meta", version=2, dtype="float16"), ev("step", 1, scale=2.0 ** 10),
              ev("grad_hist", 2, module="fc", lo=-20, counts=[3, 1], zeros=0, nonfinite=0, scale=None),
              ev("step", 2, scale=2.0 ** 10)]
    g = summarize(events)["grad_hist"]
    assert g["scale_source"] == "steps" and g["scale_log2"] == 10
    assert (g["unscaled"]["min_log2"], g["unscaled"]["max_log2"]) == (-30, -29)
    assert g["unscaled"]["flushed_share"] == 1.0 and g["scaled"]["subnormal_share"] == 1.0


def test_fit_scale_caps_at_overflow_and_bf16_needs_none():
    fp16 = dtype_range("float16")
    wide = {-40: 100, -20: 1000, 10: 10}            # 51 binades: wider than fp16's 40
    fit = fit_scale(wide, fp16, low_share=0.001, headroom_bits=2)
    assert fit == {"init_scale_log2": 15 - 2 - 10, "needed_log2": 26, "max_scale_log2": 3, "fits": False}
    assert shares(wide, fp16)["flushed_share"] == pytest.approx(100 / 1110)
    bf16 = dtype_range("bfloat16")
    assert (bf16["min_normal_log2"], bf16["min_subnormal_log2"]) == (-126, -133)
    fit = fit_scale(wide, bf16, low_share=0.001, headroom_bits=2)
    assert fit["fits"] and fit["init_scale_log2"] == 0
    assert shares(wide, bf16)["flushed_share"] == 0


def test_version_1_traces_have_no_section():
    events, problems = read_trace(ASSETS / "report_run.jsonl")
    summary = summarize(collect(events), problems)
    assert summary["grad_hist"] is None and "grad_hist" not in summary["unknown_events"]
    assert not [r for r in summary["recommendations"] if r["kind"] == "grad_scale"]


# ---- the page, drawn by headless Chromium -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drawn(scaled_trace):
    pytest.importorskip("plotly")
    from test_report_html import _chromium, _png_rgb, render

    from ampaudit.report.html import write_html

    if _chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    events, problems = read_trace(scaled_trace)
    page = write_html(scaled_trace.parent / "gh.html", events, problems, trace=str(scaled_trace))
    shot = page.parent / "gh.png"
    dom = render(page, shot, height=1400)
    return dom, _png_rgb(shot).astype(int)


@pytest.mark.slow
def test_browser_draws_both_histograms_and_the_dtype_bands(drawn):
    dom, _ = drawn
    start = dom.index('id="plot-gradhist"')
    part = dom[start:dom.index("<h2>", start)]
    assert 'class="main-svg"' in part, "plotly drew nothing"
    bars = re.findall(r'<g class="trace bars"', part)
    points = re.findall(r'<g class="point"><path d="M', part)
    assert len(bars) == 2 and len(points) >= 20, (len(bars), len(points))
    for text in ("rounds to 0 (&lt; 2^-25)", "subnormal (2^-24 is the smallest)", "normal (from 2^-14)",
                 "overflow (from 2^16)", "without loss scaling", "with the run's loss scale (2^16)"):
        assert text in part, text


@pytest.mark.slow
def test_screenshot_puts_unscaled_bars_below_the_subnormal_range_and_scaled_ones_inside(drawn):
    np = pytest.importorskip("numpy")
    _, px = drawn
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    # The bands' fills over white: "rounds to 0" pink, "subnormal" yellow.
    pink = (abs(r - 248) <= 3) & (abs(g - 220) <= 3) & (abs(b - 220) <= 3)
    yellow = (abs(r - 255) <= 2) & (abs(g - 241) <= 3) & (abs(b - 200) <= 3)
    rows = np.where(pink.any(axis=1))[0]
    assert rows.size > 100, "no flush band drawn"
    plot = slice(rows.min(), rows.max() + 1)          # the plot area: legend and title lie above it
    left = np.where(pink[plot].any(axis=0))[0].min()
    sub = np.where(yellow[plot].any(axis=0))[0]
    assert sub.size > 100, "no subnormal band drawn"
    orange = (r > 200) & (g > 110) & (g < 190) & (b < 120)         # #ff7f0e at 0.75 opacity
    blue = (b > 150) & (r < 120) & (g < 160)                        # #1f5fa8 at 0.75 opacity
    oc = np.where(orange[plot].any(axis=0))[0]
    bc = np.where(blue[plot].any(axis=0))[0]
    bc = bc[bc >= left]
    assert oc.size > 100 and bc.size > 100, (oc.size, bc.size)
    assert oc.max() < sub.min(), "an unscaled bar reaches the subnormal range"
    assert bc.min() >= sub.min(), "a scaled bar lies below the smallest subnormal"
    assert ((bc >= sub.min()) & (bc <= sub.max())).mean() > 0.5, "the scaled bars are not mostly subnormal"
