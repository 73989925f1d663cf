"""The command line's own surface: --version, one-line usage errors, bare-flag defaults, tables at any width."""
from __future__ import annotations

import io
import re
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
from rich.console import Console

from ampaudit.cli.app import bare_values, piped_width


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "ampaudit", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.slow
def test_version_prints_the_installed_version():
    from importlib.metadata import version

    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ampaudit {version('ampaudit')}"


@pytest.mark.parametrize("args, says", [
    (("check",), "Missing argument 'target'; see 'ampaudit check --help'"),
    (("check", "model.py", "--xyzzy"), "No such option: --xyzzy; see 'ampaudit check --help'"),
    (("nosuchcommand",), "see 'ampaudit --help'"),
])
@pytest.mark.slow
def test_usage_errors_are_one_line_and_exit_2(args, says):
    r = _run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert "╭" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_findings_still_exit_1_through_the_entry_point():
    r = _run("check", "samples/misaligned_mlp.py", "--format", "json")
    assert r.returncode == 1 and '"findings"' in r.stdout


@pytest.mark.parametrize("argv, expect", [
    (["train", "m.py", "--checkpoint-activations", "--save", "x.pt"],
     ["train", "m.py", "--checkpoint-activations", "auto", "--save", "x.pt"]),
    (["train", "m.py", "--checkpoint-activations"], ["train", "m.py", "--checkpoint-activations", "auto"]),
    (["train", "--checkpoint-activations", "m.py"], ["train", "--checkpoint-activations", "auto", "m.py"]),
    (["train", "--checkpoint-activations", "pkg.mod:build"],
     ["train", "--checkpoint-activations", "auto", "pkg.mod:build"]),
    (["train", "m.py", "--checkpoint-activations", "Block,MLP"],
     ["train", "m.py", "--checkpoint-activations", "Block,MLP"]),
])
def test_bare_checkpoint_activations_means_auto(argv, expect):
    assert bare_values(argv) == expect


def test_piped_output_follows_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert piped_width() == 80
    monkeypatch.setenv("COLUMNS", "junk")
    assert piped_width() == 120
    monkeypatch.delenv("COLUMNS")
    assert piped_width() == 120


def _plan():
    from ampaudit.planning.choose import Budget

    reasons = ["out_features 58 not a multiple of 16 (--pad pads it without changing results); predicted 1.68x "
               "slower in fp8 (memory-bound at 1024 tokens)"]
    metrics = {"float8_tensorwise": {"output": {"sqnr_db": 28.81}, "grad_input": {"sqnr_db": 29.61},
                          "grad_weight": {"sqnr_db": 33.41}, "model_grads": {"sqnr_db": 32.0}}}
    layers = [NS(module=f"blocks.{i}.attention.output_projection", in_features=64, out_features=58, tokens=1024,
                 choice="bfloat16", torchao=False, speedup=0.6, reasons=reasons, metrics=metrics, gemms=None)
              for i in range(2)]
    summary = {"layers": 2, "low_precision": 0, "float8_tensorwise": 0, "bfloat16": 2, "float32": 0,
               "torchao_filter_differs": 0}
    return NS(recipes=("float8_tensorwise",), speed_model="h100", budget=Budget(20, 15), layers=layers,
              notes=[], summary=lambda: summary), reasons[0]


@pytest.mark.parametrize("width", [80, 100, 120, 160])
def test_plan_table_keeps_every_word_at_any_width(width):
    from ampaudit.planning.report import render_plan

    plan, reason = _plan()
    console = Console(width=width, file=io.StringIO(), record=True)
    render_plan(plan, console)
    text = console.export_text()
    words = set(re.findall(r"\S+", text))
    assert [w for w in reason.split() if w not in words] == []          # the "why" wraps whole words
    assert "…" not in text                                              # no cell is cut short
    assert max(map(len, text.splitlines())) <= width


class _TenWay(__import__("torch").nn.Module):
    """Numerically clean; only its 10-way head is off the Tensor Core multiple."""

    def __init__(self):
        import torch

        super().__init__()
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x).relu())


@pytest.mark.slow
def test_speed_findings_do_not_fail_the_safety_gate():
    import torch

    from ampaudit.testing import AmpSafetyError, assert_amp_safe

    report = assert_amp_safe(_TenWay(), torch.randn(8, 64), fail_on="info")
    assert report.findings and all(f.is_speed for f in report.findings)     # reported, not failed
    with pytest.raises(AmpSafetyError, match="is not mixed-precision fast"):
        assert_amp_safe(_TenWay(), torch.randn(8, 64), fail_on="info", speed=True)


def test_alignment_on_a_cpu_target_is_an_info_worded_for_the_cpu():
    import torch

    import ampaudit

    cuda = ampaudit.check(_TenWay(), torch.randn(8, 64))
    cpu = ampaudit.check(_TenWay(), torch.randn(8, 64), device="cpu", dtype="bfloat16")
    assert {f.rule for f in cpu.findings} == {f.rule for f in cuda.findings} == {"AMP101"}
    for f in cpu.findings:
        assert f.severity == "info" and "CPU" in f.message and "CPU" in f.why
        assert "Tensor Core kernels" not in f.message and "cuBLAS" not in f.why and "cuDNN" not in f.why
    assert any("Tensor Core" in f.message + f.why for f in cuda.findings)


def test_a_clean_calibration_says_it_measured_nothing(planted):
    import ampaudit
    from conftest import SAMPLES, load_module

    clean = load_module(SAMPLES / "clean_mlp.py")
    notes = ampaudit.check(clean.build_model(), *clean.example_inputs(), calibrate=True).notes
    assert any(n.startswith("calibrated on 1 batch(es)") and n.endswith(
        ": no measured faults (no inf/NaN, range, divergence, flipped decision or update that rounds away)")
        for n in notes)
    bad = planted("gelu_cube")
    notes = ampaudit.check(bad.build_model(), *bad.example_inputs(), device="cpu", calibrate=True).notes
    assert any(n.startswith("calibrated on") for n in notes) and not any("no measured faults" in n for n in notes)


def test_a_calibration_that_skipped_a_measurement_says_so_beside_no_faults(monkeypatch):
    # The decision comparison raised and was skipped: "no measured faults" holds only for what was measured.
    import ampaudit
    import ampaudit.runtime.decision_record as decision_record
    from conftest import SAMPLES, load_module

    def boom(*args, **kwargs):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(decision_record, "measure_decisions", boom)
    clean = load_module(SAMPLES / "clean_mlp.py")
    notes = ampaudit.check(clean.build_model(), *clean.example_inputs(), calibrate=True).notes
    assert any(n.startswith("decisions not compared with FP32: RuntimeError") for n in notes), notes
    assert any(n.startswith("calibrated on 1 batch(es)") and n.endswith(
        "update that rounds away) in what was measured (the notes below say what was not)") for n in notes), notes


def test_nonfinite_findings_json_fields_are_plain_values():
    import ampaudit
    from conftest import ROOT, load_module

    m = load_module(ROOT / "tests" / "planted" / "sqrt_underflow_grad.py")
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device="cpu", calibrate=True)
    found = [f for f in report.findings if f.rule == "AMP601"]
    assert found and {f.details["phase"] for f in found} <= {"forward", "backward"}
    assert all("error" not in f.details for f in found)                  # AMP601 is no error message
    assert any(f.details["phase"] == "backward" and "in the backward pass" in f.message for f in found)


def test_an_fsdp_run_prints_its_preflight_lines(tmp_path):
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401
    from ampaudit.cli.app import app
    from conftest import ASSETS

    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "1", "--device", "cpu",
                                 "--fsdp", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("preflight ")]
    names = {ln.split()[2].rstrip(":") for ln in lines}
    assert {"groups", "masters", "reduce", "memory"} <= names, r.stderr
    assert all(ln.split()[1] in ("ok", "warn") for ln in lines)


def test_fsdp_keeps_batchnorm_in_fp32():
    """Under --fsdp a BatchNorm in the bf16 group met fp32 running stats and the kernel raised at step 1."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ampaudit.train.trainer import Trainer
    from conftest import ASSETS, load_module

    mlp = load_module(ASSETS / "train_mlp.py")
    with Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, dtype="bfloat16", fsdp=True, device="cpu",
                 handle_signals=False) as t:
        t.fit(steps=2)
        bn = next(m for m in t.model.modules() if isinstance(m, nn.BatchNorm1d))
        assert bn.running_var.dtype == torch.float32 and bn.weight.dtype == torch.float32
    assert not dist.is_initialized()


def test_an_unmeasured_detail_is_null_in_json_and_a_question_mark_in_text(tmp_path):
    import torch
    from torch import nn

    import ampaudit
    from ampaudit.rules.registry import MATCHERS, Hit, matcher

    @matcher("_test_unmeasured", fields={"share"})
    def _unmeasured(ctx, rule):
        yield Hit(next(iter(ctx.gm.graph.nodes)), {"share": None})

    try:
        (tmp_path / "r.toml").write_text('[[rule]]\nid = "X900"\nname = "unmeasured"\nfamily = "alignment"\n'
                                         'severity = "info"\nmatcher = "_test_unmeasured"\n'
                                         'message = "({share} of the work)"\nwhy = "w"\n')
        report = ampaudit.check(nn.Linear(8, 8), torch.randn(2, 8), rules_dirs=[tmp_path], select=["X900"])
        (f,) = report.findings
        assert f.message == "(? of the work)" and f.as_dict()["details"]["share"] is None
    finally:
        MATCHERS.pop("_test_unmeasured", None)
