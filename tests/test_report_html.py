"""The HTML report (ampaudit/report/html.py, html_plots.py): the page's content, and the page as a browser draws it.

The browser test renders the page in headless Chromium (Debian's `chromium` package) and checks that every plot
drew SVG with data in it and that the screenshot shows coloured plot marks; it skips where Chromium is absent.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

pytest.importorskip("plotly")

from ampaudit.errors import UsageError  # noqa: E402
from ampaudit.report.html import build_html, write_atomic, write_html  # noqa: E402
from ampaudit.runtime.trace import read_trace  # noqa: E402
from trace_events import ev

ASSETS = Path(__file__).parent / "assets"
PLOTS = ["plot-loss", "plot-scale", "plot-grad", "plot-divergence", "plot-headroom"]


@pytest.fixture(scope="module")
def run_page(tmp_path_factory) -> Path:
    events, problems = read_trace(ASSETS / "report_run.jsonl")
    return write_html(tmp_path_factory.mktemp("html") / "run.html", events, problems, trace="report_run.jsonl")


def test_page_is_self_contained(run_page):
    page = run_page.read_text()
    for div in PLOTS:
        assert f'id="{div}"' in page, div
    assert "<script src=" not in page and "<link" not in page  # nothing fetched from the network
    assert len(page) > 3_000_000  # plotly.js itself is inline
    summary = json.loads(re.search(r"id='ampaudit-summary'>(.*?)</script>", page, re.S).group(1))
    assert summary["first_nonfinite"]["module"] == "blocks.1.attn"
    assert "ampaudit.keep_fp32(model, [&quot;blocks.1.attn&quot;])" in page
    # The divergence heatmap ranks the culprit first and says so, as the terminal table does.
    assert summary["divergence"]["culprits"][0]["module"] == "blocks.1.attn"
    assert "blocks.1.attn (culprit #1)" in page


def test_page_mode_is_not_private(run_page):
    # The temporary file the page is written through is 0600; the page must not stay that way.
    assert stat.S_IMODE(run_page.stat().st_mode) & 0o044


def test_plots_without_data_say_so():
    events, problems = read_trace(ASSETS / "report_corrupt.jsonl")
    page = build_html(events, problems, trace="report_corrupt.jsonl")
    assert "id='plot-scale-empty'" in page and "id='plot-grad-empty'" in page  # bf16: no scaler, no norms
    assert "id='plot-divergence-empty'" in page  # its one divergence event has no number
    assert 'id="plot-loss"' in page and 'id="plot-headroom"' in page
    assert "corrupt line, skipped" in page


def test_module_names_are_escaped():
    events = [ev("step", 1, loss=1.0), ev("nonfinite", 1, module="</script><b>x", phase="forward", kind="nan")]
    page = build_html(events, [])
    assert "</script><b>x" not in page
    assert "&lt;/script&gt;&lt;b&gt;x" in page


def test_write_atomic_keeps_the_old_page_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "r.html"
    target.write_text("old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(UsageError, match="No space left"):
        write_atomic(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_long_series_are_thinned_keeping_spikes():
    from ampaudit.report.html_plots import MAX_POINTS, _thin, grad_figure
    from ampaudit.report.trace_summary import collect

    n = 50_000
    events = [ev("step", i, loss=1.0, grad_norm=100.0 if i == 31_337 else 1.0, scale=1024.0, skipped=True,
                 clipped=True) for i in range(1, n + 1)]
    fig = grad_figure(collect(events))
    line, clipped = fig.data[0], fig.data[1]
    assert len(line.x) <= MAX_POINTS and len(clipped.x) <= MAX_POINTS
    assert 100.0 in line.y and 31_337 in line.x  # the one spike survives
    xs, ys = _thin(list(range(10)), [0.0] * 10)
    assert xs == list(range(10))  # short series untouched


# ---- rendered in a browser -------------------------------------------------------------------------------

def _png_rgb(path: Path):
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) to an (h, w, 3) uint8 array."""
    np = pytest.importorskip("numpy")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, chunk = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
    assert depth == 8 and ctype in (2, 6) and interlace == 0, "unexpected PNG format"
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.uint8)
    for y in range(h):
        f, x = raw[y, 0], raw[y, 1:]
        if f == 0:
            cur = x.copy()
        elif f == 1:  # Sub: running sum along the row, per channel
            cur = np.cumsum(x.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif f == 2:  # Up
            cur = x + prev
        else:  # Average and Paeth depend on the pixel just decoded: byte by byte
            xs, up, row = x.tolist(), prev.tolist(), [0] * (w * bpp)
            for i in range(w * bpp):
                a = row[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    row[i] = (xs[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (xs[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.array(row, np.uint8)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)[:, :, :3]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(page, shot, height: int = 3000) -> str:
    """Load ``page`` in headless Chromium (skip without it), screenshot it to ``shot``; return the DOM."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size=1400,{height}",
         "--virtual-time-budget=5000", f"--screenshot={shot}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def rendered(run_page):
    shot = run_page.parent / "shot.png"
    return render(run_page, shot), shot


@pytest.mark.slow
def test_browser_draws_every_plot(rendered):
    dom, _ = rendered
    starts = [dom.index(f'id="{div}"') for div in PLOTS] + [len(dom)]
    parts = {div: dom[a:b] for div, a, b in zip(PLOTS, starts, starts[1:])}
    for div, part in parts.items():
        assert 'class="main-svg"' in part, f"{div}: plotly drew nothing"
    # Lines with real data in them (a path of many points), heatmap cells, bars.
    for div in ("plot-loss", "plot-scale", "plot-grad"):
        paths = re.findall(r'<path class="js-line" d="(M[^"]*)"', parts[div])
        assert paths and max(len(re.findall("[LHV]", p)) for p in paths) > 50, f"{div}: no line drawn"
        assert re.search(r'class="point"[^>]*d="M', parts[div]), f"{div}: no markers drawn"
    assert re.search(r'<g class="hm"[^>]*>\s*<image', parts["plot-divergence"]), "no heatmap drawn"
    assert len(re.findall(r'class="point"', parts["plot-headroom"])) == 12, "expected 6 modules x 2 phases"
    assert "first non-finite: blocks.1.attn" in parts["plot-scale"]


@pytest.mark.slow
def test_screenshot_shows_the_plots(rendered):
    _, shot = rendered
    px = _png_rgb(shot).astype(int)
    h, w, _ = px.shape
    assert (h, w) == (3000, 1400)
    colored = (px.max(axis=2) - px.min(axis=2)) > 60  # plot marks are saturated; text and grid are grey
    assert colored.mean() > 0.01, f"only {colored.mean():.2%} coloured pixels"
    # Coloured marks spread down the page (five plots), not one blob.
    bands = {y // 150 for y in range(h) if colored[y].sum() > 20}
    assert len(bands) >= 8, sorted(bands)
    # The heatmap's worst cells are red-orange (YlOrRd), the lines blue (#1f5fa8).
    red = (px[:, :, 0] > 200) & (px[:, :, 1] < 120) & (px[:, :, 2] < 80)
    blue = (abs(px[:, :, 0] - 0x1f) < 30) & (abs(px[:, :, 1] - 0x5f) < 30) & (abs(px[:, :, 2] - 0xa8) < 30)
    assert red.sum() > 2000 and blue.sum() > 2000, (int(red.sum()), int(blue.sum()))


def test_the_page_says_when_the_only_overflows_were_the_loss_scalers_probing():
    probe = dict(phase="backward", module="head", op="aten.mm", source="m.py:47", kind="inf", cause="op",
                 dtype="torch.float16", low_precision=True, fp32_too=False, scaled_only=True)
    events = [ev("step", 1, loss=1.1, scale=65536.0, skipped=True), ev("nonfinite", 1, **probe),
              ev("step", 2, loss=1.0, scale=32768.0, skipped=False)]
    page = build_html(events, [])
    assert "none recorded (1 overflow was the loss scaler&#x27;s own probing: a skipped step, as designed)" in page
    assert "none recorded" not in build_html([ev("step", 1, loss=1.0)], [])
