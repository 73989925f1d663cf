"""`ampaudit train` on the command line: a run with --save and --trace, errors, the halt exit code."""
import json
from pathlib import Path

import pytest
import torch
from conftest import ASSETS
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.runtime.trace import read_trace

MLP = str(ASSETS / "train_mlp.py")


def run(*args: str):
    return CliRunner(env={"COLUMNS": "160"}).invoke(app, ["train", *args])


@pytest.mark.slow
def test_train_saves_weights_and_writes_trace(tmp_path):
    final, trace = tmp_path / "final.pt", tmp_path / "run.jsonl"
    r = run(MLP, "--steps", "6", "--accum", "2", "--clip-norm", "1", "--opt-level", "O2", "--save", str(final),
            "--trace", str(trace), "--trace-every", "2")
    assert r.exit_code == 0, r.output
    assert "trained 6 steps (0 skipped)" in r.stdout
    state = torch.load(final, weights_only=True)
    assert state["fc1.weight"].dtype == torch.float16 and state["bn.running_var"].dtype == torch.float32
    events, problems = read_trace(trace)
    assert not problems and events[0]["event"] == "meta" and events[0]["opt_level"] == "O2"
    assert events[0]["scaler"]["dynamic"] is True and events[0]["scaler"]["init_scale"] == 65536.0
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 6
    for field in ("loss", "scale", "skipped", "grad_norm", "clipped", "lr", "time"):
        assert field in steps[0]


def test_epochs_and_progress(tmp_path):
    r = run(MLP, "--epochs", "1", "--accum", "8", "--dtype", "bfloat16", "--progress")
    assert r.exit_code == 0, r.output
    assert "trained 8 steps" in r.stdout and "loss scale off" in r.stdout


def test_dtype_float8_plans_first_then_trains():
    pytest.importorskip("torchao")
    r = run(MLP, "--steps", "2", "--dtype", "float8", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "plan: " in r.stderr and "float8 layer(s)" in r.stderr and "trained 2 steps" in r.stdout


def test_missing_train_data_says_what_to_add():
    r = run(str(ASSETS / "train_no_hooks.py"), "--steps", "2")
    assert r.exit_code == 2
    assert "has no train_data() and no loss_fn()" in r.stderr and "def train_data(): yield" in r.stderr
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args, needle", [
    ([], "--steps N or --epochs E"), (["--steps", "2", "--epochs", "1"], "--steps N or --epochs E"),
    (["--steps", "2", "--clip-norm", "1", "--clip-value", "1"], "not both; drop --clip-norm or --clip-value"),
    (["--steps", "2", "--accum", "0"], "accum must be >= 1, got 0; e.g. --accum 4"),
    (["--steps", "2", "--clip-norm", "-1"], "--clip-norm must be a positive number, got -1.0; e.g. --clip-norm 1.0"),
    (["--steps", "2", "--dtype", "int8"], "unsupported training dtype"),
    (["--steps", "2", "--checkpoint-every", "5"], "needs --checkpoint"),
    (["--steps", "2", "--resume"], "needs a checkpoint directory; pass --checkpoint DIR with --resume"),
    (["--steps", "2", "--hysteresis", "0"], "hysteresis must be >= 1"),
    (["--steps", "2", "--divergence-every", "5"], "--divergence-every needs --trace"),
    (["--steps", "2", "--divergence-every", "5", "--trace", "x.jsonl", "--opt-level", "O2"], "use --opt-level O1 with --divergence-every"),
    (["--steps", "2", "--divergence-every", "0", "--trace", "x.jsonl"], "--divergence-every must be >= 1"),
])
def test_bad_options_are_one_line_errors(args, needle):
    r = run(MLP, *args)
    assert r.exit_code == 2 and needle in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_halt_exits_3_with_checkpoint_and_diagnosis(tmp_path):
    ckpt, trace = tmp_path / "ckpt", tmp_path / "run.jsonl"
    r = run(str(ASSETS / "train_overflow.py"), "--steps", "100", "--init-scale", "8", "--max-consecutive-skips",
            "6", "--checkpoint", str(ckpt), "--trace", str(trace))
    assert r.exit_code == 3, r.output
    assert "training halted at step 6" in r.stderr and "non-finite gradients in:" in r.stderr
    diagnosis = json.loads((ckpt / "halt.json").read_text())
    assert diagnosis["scale"] == 1.0 and diagnosis["consecutive_skips"] == 6   # stuck at the floor, not 0
    assert {m["module"] for m in diagnosis["overflowing_modules"]} >= {"0", "2"}
    assert torch.load(ckpt / "halted.pt", weights_only=True)["step"] == 6
    events, _ = read_trace(trace)
    assert [e["event"] for e in events].count("skip") == 6 and events[-1]["event"] == "halt"


def test_resume_says_what_it_does(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = run(MLP, "--steps", "2", "--checkpoint", str(ckpt), "--resume", "--dtype", "bfloat16")
    assert r.exit_code == 0 and "starting fresh" in r.stderr, r.output
    assert torch.load(ckpt / "last.pt", weights_only=True)["step"] == 2     # the end state is saved
    r = run(MLP, "--steps", "5", "--checkpoint", str(ckpt), "--resume", "--dtype", "bfloat16")
    assert r.exit_code == 0 and "resuming from" in r.stderr and "trained 5 steps" in r.stdout, r.output
    assert torch.load(ckpt / "last.pt", weights_only=True)["step"] == 5


@pytest.mark.slow
def test_train_tensorboard_needs_trace_and_writes_scalars(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("tensorboard")
    model = Path(__file__).parent / "assets" / "train_mlp.py"
    r = subprocess.run([sys.executable, "-m", "ampaudit", "train", str(model), "--steps", "2", "--device", "cpu",
                        "--tensorboard", str(tmp_path / "tb")], capture_output=True, text=True)
    assert r.returncode == 2 and "needs --trace" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ampaudit", "train", str(model), "--steps", "3", "--device", "cpu",
                        "--trace", str(tmp_path / "run.jsonl"), "--tensorboard", str(tmp_path / "tb")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "TensorBoard scalars" in r.stderr and any((tmp_path / "tb").rglob("events.out.tfevents*"))


def test_divergence_every_writes_fp32_comparisons_the_report_reads(tmp_path):
    trace = tmp_path / "run.jsonl"
    r = run(MLP, "--steps", "8", "--dtype", "bfloat16", "--trace", str(trace), "--divergence-every", "4")
    assert r.exit_code == 0, r.output
    events, problems = read_trace(trace)
    div = [e for e in events if e["event"] == "divergence"]
    assert not problems and {e["step"] for e in div} == {4, 8}
    assert {e["scope"] for e in div if e["step"] == 4} == {"global", "local", "grad"}   # check 0: every scope
    assert all(0 <= e["rel_l2"] < 0.1 for e in div if e["scope"] == "global")
    report = CliRunner(env={"COLUMNS": "160"}).invoke(app, ["report", str(trace)])
    assert report.exit_code == 0 and "Divergence vs FP32" in report.output


PLANTED_T5 = Path(__file__).parent / "planted" / "t5_ff_wo_fp16.py"


@pytest.mark.parametrize("entry", ["build_fixed_model", "build_model"])
def test_t5_ff_wo_twin_is_quiet_and_the_planted_model_still_named(tmp_path, entry):
    # fp16 by nature (T5's FF `wo` past 65504). The trainer starts at scale 2^16, which overflows head's weight
    # gradient once: the scaler's probing (scaled_only), never keep_fp32's evidence nor the first non-finite.
    # The fix keeps `wo` in FP32: above fp16's max, said so (fp32_range), but not told to keep FP32 again.
    from ampaudit.report.trace_summary import summarize_trace
    trace = tmp_path / "t5.jsonl"
    result = run(str(PLANTED_T5), "--steps", "2", "--device", "cpu", "--dtype", "float16", "--trace", str(trace),
                    "--divergence-every", "1", "--entry", entry)
    assert result.exit_code == 0, result.output
    events, _ = read_trace(trace)
    probes = [e for e in events if e["event"] == "nonfinite" and e.get("scaled_only")]
    assert [(e["module"], e["phase"]) for e in probes] == [("head", "backward")]
    s = summarize_trace(trace)
    keep = next((r for r in s["recommendations"] if r["kind"] == "keep_fp32"), None)
    first = s["first_nonfinite"] or {}
    if entry == "build_fixed_model":
        assert keep is None and first == {}
        assert "ff.wo" in next(r for r in s["recommendations"] if r["kind"] == "fp32_range")["message"]
    else:
        # The planted overflow: ff.wo's forward inf is the run's first non-finite, and keep_fp32 leads with it.
        assert (first.get("module"), first.get("phase")) == ("ff.wo", "forward") and keep["modules"][0] == "ff.wo"
