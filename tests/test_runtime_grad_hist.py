"""Histograms of log2|gradient| (ampaudit/runtime/grad_hist.py): exact bins, loss scales, and the watch's events
on tiny_grads, whose gradients (~1e-9) flush to zero in fp16 unless the loss is scaled."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from ampaudit.runtime.grad_hist import LO, NBINS, NONFINITE, ZERO, GradHistograms, log2_counts
from ampaudit.runtime.trace import TRACE_VERSION, read_trace
from ampaudit.runtime.watch import watch

from conftest import load_planted


def _reference(values: list[float], dtype: torch.dtype) -> tuple[dict[int, int], int, int]:
    """Bins by Python's own frexp on the values as the dtype holds them."""
    held = torch.tensor(values, dtype=torch.float64).to(dtype).double().tolist()
    bins: dict[int, int] = {}
    zeros = bad = 0
    for v in held:
        if not math.isfinite(v):
            bad += 1
        elif v == 0 or (dtype == torch.float32 and abs(v) < 2.0 ** -133):   # below the top-16-bit view
            zeros += 1
        else:
            e = math.frexp(v)[1] - 1
            bins[e] = bins.get(e, 0) + 1
    return bins, zeros, bad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bins_are_floor_log2_including_subnormals_zeros_and_nonfinite(dtype):
    g = torch.Generator().manual_seed(0)
    # Magnitudes over 300 binades (most outside fp16: they become 0 or inf there), both signs, plus edge values.
    values = (torch.randn(5000, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-150, 130, (5000,),
              generator=g).double()).tolist()
    values += [0.0, -0.0, 2.0 ** -24, 2.0 ** -25 * 1.5, 2.0 ** -14, 2.0 ** -133, 65504.0, -1.0, 0.75, math.inf,
               -math.inf, math.nan]
    counts = log2_counts(torch.tensor(values, dtype=torch.float64).to(dtype)).tolist()
    bins, zeros, bad = _reference(values, dtype)
    got = {LO + i: n for i, n in enumerate(counts[:NBINS]) if n}
    assert got == bins
    assert (counts[ZERO], counts[NONFINITE]) == (zeros, bad)
    assert sum(counts) == len(values)


def test_passes_at_other_scales_are_shifted_to_the_latest():
    hist = GradHistograms()
    hist.observe([0], torch.full((4,), 2.0 ** -10, dtype=torch.float16), step=1)
    hist.note_scale(2.0 ** 16, step=1)
    hist.observe([0, 1], torch.full((2,), 2.0 ** -12, dtype=torch.float16), step=2)   # one tensor, two modules
    hist.note_scale(2.0 ** 15, step=2)          # the scaler backed off: step 1's values are one bin too high
    (a, b) = hist.drain([("fc", "backward"), ("block", "backward")])
    assert (a["module"], a["step"], a["scale"], a["numel"], a["passes"]) == ("fc", 2, 2.0 ** 15, 6, 2)
    assert (a["lo"], a["counts"]) == (-12, [2, 4])      # 2^-10 at 2^16 is 2^-11 at 2^15
    assert (b["module"], b["lo"], b["counts"], b["passes"]) == ("block", -12, [2], 1)
    assert hist.drain([]) == []                 # drained
    # A later pass with no scale of its own takes the latest noted one.
    hist.observe([0], torch.ones(3), step=9)
    (c,) = hist.drain([("fc", "backward")])
    assert c["scale"] == 2.0 ** 15 and (c["lo"], c["counts"], c["zeros"]) == (0, [3], 0)


def _train(planted, w, steps: int, scaler: torch.amp.GradScaler | None):
    model = w.root
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(itertools.islice(planted.train_data(), steps)):
        w.set_step(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = planted.loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_tiny_grads_histograms_sit_below_fp16s_range_until_scaled(tmp_path):
    planted = load_planted("tiny_grads")
    scaler = torch.amp.GradScaler("cpu")
    trace = tmp_path / "run.jsonl"
    with watch(planted.build_model(), trace=trace, every=5, stats_every=8, scaler=scaler) as w:
        _train(planted, w, 10, scaler)
    events, problems = read_trace(trace)
    assert not problems and events[0]["version"] == TRACE_VERSION >= 2   # grad_hist came with version 2
    hist = [e for e in events if e["event"] == "grad_hist"]
    # One event per module and interval, from its first sampled pass (one in stats_every=8: steps 0 and 8),
    # with the scale its gradients carried.
    assert sorted({e["step"] for e in hist}) == [0, 8]
    assert {e["module"] for e in hist} == {"", "body", "body.0", "body.1", "body.2", "body.3", "head"}
    for e in hist:
        assert e["phase"] == "backward" and e["scale"] == 65536.0 and e["passes"] == 1
        assert sum(e["counts"]) + e["zeros"] + e["nonfinite"] == e["numel"]
        assert e["numel"] == (32 if e["module"] in ("", "head") else 32 * 64)
        top = e["lo"] + len(e["counts"]) - 1
        # As measured, scaled by 2^16: at or above fp16's smallest subnormal, mostly below its smallest normal.
        assert e["lo"] >= -24 and top < 0
        # Unscaled (2^-16): every value below half the smallest subnormal, so it would round to zero.
        assert top - 16 < -25
    # Without a scaler the same gradients reach the hooks as fp16 zeros already.
    plain = load_planted("tiny_grads")
    with watch(plain.build_model(), every=5) as w:
        _train(plain, w, 5, None)
    body = [e for e in w.events if e["event"] == "grad_hist" and e["module"] == "body.1"]
    assert body and body[0]["zeros"] == body[0]["numel"] and body[0]["counts"] == [] and body[0]["scale"] is None


def test_set_loss_scale_and_switches():
    planted = load_planted("tiny_grads")
    with watch(planted.build_model(), every=5) as w:
        w.set_loss_scale(1024.0)                 # the loop scales its loss by hand
        _train(planted, w, 2, None)
    assert {e["scale"] for e in w.events if e["event"] == "grad_hist"} == {1024.0}
    for kwargs in ({"grad_hist": False}, {"stats": False}):
        with watch(planted.build_model(), every=5, **kwargs) as w:
            _train(planted, w, 2, None)
        assert not [e for e in w.events if e["event"] == "grad_hist"], kwargs
