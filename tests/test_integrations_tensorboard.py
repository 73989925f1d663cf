"""TensorBoard: a trace's scalars written through torch.utils.tensorboard, read back with TensorBoard itself."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.integrations import MissingExtraError
from ampaudit.runtime.trace import read_trace

ASSETS = Path(__file__).resolve().parent / "assets"
RUN = ASSETS / "report_run.jsonl"


def _read(logdir: Path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                      reason="tensorboard is not installed")
    acc = accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_round_trip(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from ampaudit.integrations.tensorboard import write_tensorboard

    events, _ = read_trace(RUN)
    count = write_tensorboard(events, tmp_path / "tb")
    acc = _read(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    steps = [e for e in events if e["event"] == "step"]
    loss = acc.Scalars("train/loss")
    # the step whose loss was inf (step 180 of this run) is left out rather than plotted
    assert [s.step for s in loss] == [e["step"] for e in steps if isinstance(e["loss"], float)]
    assert len(loss) == len(steps) - 1
    assert math.isclose(loss[0].value, steps[0]["loss"], rel_tol=1e-6)
    skipped = {s.step for s in acc.Scalars("train/skipped") if s.value == 1.0}
    assert skipped == {e["step"] for e in steps if e["skipped"]}
    assert acc.Scalars("train/skipped_total")[-1].value == len(skipped)
    assert all(math.isfinite(s.value) for s in acc.Scalars("train/grad_norm"))
    assert len(acc.Scalars("train/grad_norm")) == sum(1 for e in steps if isinstance(e["grad_norm"], float))
    assert math.isclose(acc.Scalars("train/loss_scale_log2")[0].value, 16.0)
    stats = [e for e in events if e["event"] == "stats" and e["module"] == "embed" and e["phase"] == "forward"]
    head = acc.Scalars("headroom/forward/embed")
    assert [s.step for s in head] == [e["step"] for e in stats]
    assert math.isclose(head[0].value, stats[0]["headroom_bits"], rel_tol=1e-5)
    assert {"divergence/local/embed/rel_l2", "divergence/global/blocks.0.attn/sqnr_db",
            "absmax/backward/head"} <= tags
    assert any(t.startswith("divergence/grad/") for t in tags)
    assert count == sum(len(acc.Scalars(t)) for t in tags)
    assert "skip/text_summary" in acc.Tags()["tensors"] and "nonfinite/text_summary" in acc.Tags()["tensors"]


def test_report_tensorboard_option(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    result = CliRunner().invoke(app, ["report", str(RUN), "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    assert "TensorBoard scalars to" in result.output
    assert len(_read(tmp_path / "tb").Scalars("train/skipped")) == 300


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)         # import tensorboard -> ImportError
    from ampaudit.integrations.tensorboard import write_tensorboard

    with pytest.raises(MissingExtraError, match=r"needs the 'tensorboard' package") as info:
        write_tensorboard([], tmp_path / "tb")
    assert info.value.hint == "pip install 'ampaudit[tensorboard]'"
    result = CliRunner().invoke(app, ["report", str(RUN), "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("error: --tensorboard needs the 'tensorboard'")
    assert not (tmp_path / "tb").exists()                          # refused before any work
