"""`ampaudit fix` end to end: OUTDIR/model.py follows the model-file protocol, loads the same weights, checks
clean for the fixed families, and the command refuses to overwrite a folder it did not write."""
from __future__ import annotations

import json

import torch
from conftest import ASSETS, PLANTED, SAMPLES
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.api import check
from ampaudit.cli.app import app
from ampaudit.loading import load_target

runner = CliRunner()


def _run(*argv):
    return runner.invoke(app, list(argv))


def test_fix_writes_a_protocol_model_file(tmp_path):
    out = tmp_path / "fixed"
    res = _run("fix", str(PLANTED / "mask_fill.py"), "-o", str(out), "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "1 fp32 island(s)" in res.output and "re-check: clean" in res.output
    assert {"model.py", "weights.pt", "fix.json", "summary.txt"} <= {p.name for p in out.iterdir()}
    meta = json.loads((out / "fix.json").read_text())
    assert meta["tool"] == "ampaudit fix" and meta["report"]["casts"] == 2
    assert "torch.load(HERE / 'weights.pt', weights_only=True)" in (out / "model.py").read_text()

    orig, fixed = load_target(str(PLANTED / "mask_fill.py")), load_target(str(out / "model.py"))
    assert list(fixed.model.state_dict()) == list(orig.model.state_dict())
    with torch.no_grad():
        assert torch.equal(fixed.model(*fixed.args), orig.model(*orig.args))
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.isfinite(fixed.model(*fixed.args)).all()
    assert fixed.hook("train_data") is not None and fixed.hook("loss_fn") is not None
    report = check(fixed.model, *fixed.args, device="cpu", select=["constant", "sensitive-op"])
    assert [f.rule for f in report.findings if f.severity != "info"] == []

    res = _run("check", str(out / "model.py"), "--device", "cpu", "--select", "constant,sensitive-op",
               "--fail-on", "warning")
    assert res.exit_code == 0, res.output
    # Writing again into its own OUTDIR is allowed.
    assert _run("fix", str(PLANTED / "mask_fill.py"), "-o", str(out), "--device", "cpu", "--no-verify").exit_code == 0


def test_fixed_model_finds_its_original_after_both_move(tmp_path):
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(PLANTED / "mask_fill.py", repo / "mask_fill.py")
    assert _run("fix", str(repo / "mask_fill.py"), "-o", str(repo / "fixed"), "--device", "cpu",
                "--no-verify").exit_code == 0
    assert "ORIGINAL = (HERE / '../mask_fill.py').resolve()" in (repo / "fixed" / "model.py").read_text()
    moved = tmp_path / "elsewhere"
    shutil.move(str(repo), str(moved))                       # a checkout elsewhere: the old path is gone
    fixed = load_target(str(moved / "fixed" / "model.py"))
    assert fixed.model(*fixed.args).shape == load_target(str(moved / "mask_fill.py")).model(*fixed.args).shape


def test_fix_refuses_foreign_outdir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    res = _run("fix", str(PLANTED / "gelu_cube.py"), "-o", str(tmp_path), "--device", "cpu")
    assert res.exit_code == 2
    assert "not written by ampaudit fix" in res.output and "Traceback" not in res.output
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_fix_untraceable_writes_the_module_tree_form(tmp_path):
    res = _run("fix", str(ASSETS / "bad" / "untraceable.py"), "-o", str(tmp_path / "o"), "--device", "cpu",
               "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    assert "form: fixed on the module tree" in res.output and "captured by dispatch" in res.output
    meta = json.loads((tmp_path / "o" / "fix.json").read_text())
    assert meta["complete"] and meta["report"]["form"] == "modules"
    fixed = load_target(str(tmp_path / "o" / "model.py"))
    original = load_target(str(ASSETS / "bad" / "untraceable.py"))
    original.model.load_state_dict(torch.load(tmp_path / "o" / "weights.pt", weights_only=True))
    assert torch.equal(fixed.model(*fixed.args), original.model(*fixed.args))


def test_fix_pad_with_input_spec(tmp_path):
    out = tmp_path / "padded"
    res = _run("fix", str(SAMPLES / "misaligned_mlp.py"), "-o", str(out), "--device", "cpu", "--pad",
               "--input", "8x1000")
    assert res.exit_code == 0, res.output
    assert "M=500 N=8 K=1000 -> M=504 N=8 K=1000" in res.output
    fixed, orig = load_target(str(out / "model.py")), load_target(str(SAMPLES / "misaligned_mlp.py"))
    assert fixed.args[0].shape == (8, 1000) and fixed.model.fc1.weight.shape == (504, 1000)
    with torch.no_grad():
        a, b = fixed.model(*fixed.args), orig.model(*fixed.args)
    assert float((a - b).abs().max()) <= 1e-6
    report = check(fixed.model, *fixed.args, device="cpu", select=["AMP101"])
    assert {(f.module, f.details["dim"]) for f in report.findings} == set()


def test_fix_calibrate_flags_measured_modules(tmp_path):
    # Static rules ignored: only the measured non-finite values in attn can put it in fp32.
    res = _run("fix", str(PLANTED / "mask_fill.py"), "-o", str(tmp_path / "c"), "--device", "cpu",
               "--calibrate", "--ignore", "constant,sensitive-op")
    assert res.exit_code == 0, res.output
    assert "AMP601" in res.output and "after max rel err" in res.output
    meta = json.loads((tmp_path / "c" / "fix.json").read_text())
    assert meta["report"]["verification"]["after"]["nonfinite"] == 0
