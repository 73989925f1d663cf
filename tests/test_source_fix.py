"""ampaudit fix --diff / --write: every fixable rule's before/after fixture (tests/source_fix/<rule>/), the
shared planted models and the samples fixed in place, formatting kept, and the CLI's flags and exit codes."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

from ampaudit.analysis.calibrate import calibration_data
from ampaudit.api import check
from ampaudit.loading import load_target
from ampaudit.sourcefix import fix_source
from ampaudit.rules.loader import load_rules
from ampaudit.sourcefix.driver import source_fix_of, wanted

HERE = Path(__file__).parent
# tests/source_fix/<rule>/before.py with after.py: what fix writes; without after.py (FIX["refused"]): a rule
# whose fixer refuses by design, and what it names instead.
FIXTURES = sorted(p.name for p in (HERE / "source_fix").iterdir() if (p / "after.py").exists())
REFUSED = sorted(p.name for p in (HERE / "source_fix").iterdir()
                 if (p / "before.py").exists() and not (p / "after.py").exists())
SHARED = HERE.parent.parent / "shared" / "planted"


def _fix_settings(path: Path) -> dict:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "FIX":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no FIX = {{...}}")


def _run(path: Path, s: dict, select=None):
    return fix_source(str(path), device=s["device"], dtype=s["dtype"], calibrate=s["calibrate"],
                      unsafe=s.get("unsafe", False), select=select)


def _fp32_out(path: Path, state=None):
    loaded = load_target(str(path))
    if state is not None:
        loaded.model.load_state_dict(state)
    torch.manual_seed(0)
    with torch.no_grad():
        return loaded.model(*loaded.args, **loaded.kwargs), loaded.model.state_dict()


def _flat(out):
    return [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


@pytest.mark.slow     # one audit and fix per rule fixture: ~25 s in all
@pytest.mark.parametrize("rule", FIXTURES)
def test_fixture_before_becomes_after(rule, tmp_path):
    before = HERE / "source_fix" / rule / "before.py"
    after = HERE / "source_fix" / rule / "after.py"
    s = _fix_settings(before)
    result = _run(before, s, select=[rule])
    changed = result.changed
    assert list(changed) == [str(before.resolve())], result.to_text()
    assert changed[str(before.resolve())] == after.read_text(), result.diff()
    assert result.verification is not None and result.verification.ok, result.to_text()
    assert {e.rule for e in result.plan.edits} == {rule}
    # The after file checks clean for the rule...
    loaded = load_target(str(after))
    report = check(loaded.model, *loaded.args, device=s["device"], dtype=s["dtype"], select=[rule],
                   calibrate=s["calibrate"], data=calibration_data(loaded) if s["calibrate"] else None,
                   **loaded.kwargs)
    # (info findings too: select names the rule, so fix acted on its infos)
    assert not [f for f in report.findings if f.rule == rule and wanted(f, {}, {rule})], \
        [f.message for f in report.findings]
    # ...computes the same FP32 result (bitwise for safe fixes), and fixing it again changes nothing.
    ref, state = _fp32_out(before)
    if not s.get("unsafe"):
        out, _ = _fp32_out(after, state)
        assert all(torch.equal(a, b) for a, b in zip(_flat(out), _flat(ref)))
    assert not _run(after, s, select=[rule]).changed


def test_every_rule_with_a_source_fix_has_a_fixture():
    fixable = {r.id for r in load_rules() if source_fix_of(r)["kind"] != "none"}
    assert fixable, "no rule has a source_fix"
    missing = sorted(fixable - set(FIXTURES) - set(REFUSED))
    assert not missing, f"no tests/source_fix/<rule>/before.py + after.py for {missing}"
    for rule in REFUSED:
        assert _fix_settings(HERE / "source_fix" / rule / "before.py").get("refused"), \
            f"tests/source_fix/{rule} has no after.py and its FIX does not say refused"


@pytest.mark.parametrize("rule", REFUSED)
def test_refused_fixture_is_left_alone_and_names_what_fixes_it(rule):
    before = HERE / "source_fix" / rule / "before.py"
    s = _fix_settings(before)
    result = _run(before, s, select=[rule])
    assert not result.changed and not result.plan.edits, result.to_text()
    loaded = load_target(str(before))
    report = check(loaded.model, *loaded.args, device=s["device"], dtype=s["dtype"], select=[rule],
                   calibrate=s["calibrate"], **loaded.kwargs)
    found = {(f.module, f.location["line"]) for f in report.findings if f.rule == rule and wanted(f, {}, {rule})}
    refused = {(r.module, r.line) for r in result.plan.refusals if r.rule == rule}
    assert found and refused == found, (found, result.to_text())
    assert all(s["refused"] in r.instead for r in result.plan.refusals), result.to_text()


def test_info_findings_are_fixed_only_for_a_rule_named_by_id_or_name():
    before = HERE / "source_fix" / "AMP201" / "before.py"
    s = _fix_settings(before)
    assert not _run(before, s, select=["sensitive-op"]).changed       # a family: warnings and errors only
    assert not _run(before, s, select=["AMP2"]).changed               # a prefix: the same
    named = _run(before, s, select=["softmax-reduced-precision"])
    assert named.changed[str(before.resolve())] == (before.parent / "after.py").read_text()


def _copies(tmp_path: Path) -> list[Path]:
    out = []
    if SHARED.is_dir():
        for p in sorted(SHARED.glob("*.py")):
            shutil.copyfile(p, tmp_path / p.name)    # content only: the shared copies may be read-only
            out.append(tmp_path / p.name)
    samples = tmp_path / "samples"
    shutil.copytree(HERE.parent / "samples", samples, copy_function=shutil.copyfile)
    return out + sorted(samples.glob("*.py"))


@pytest.mark.slow
def test_planted_and_samples_write_then_check_clean(tmp_path):
    """--write on every shared planted model and sample: a re-check (--calibrate) finds no warning or error of
    the rules an edit fixed, and FP32 outputs are bitwise unchanged (every edit here is safe)."""
    s = {"device": "cuda", "dtype": "float16", "calibrate": True}
    fixed_any = []
    for path in _copies(tmp_path):
        before = path.read_text()
        ref, state = _fp32_out(path)
        result = _run(path, s)
        assert result.verified, f"{path.name}: {result.to_text()}"
        result.write()
        if result.changed:
            fixed_any.append(path.name)
            assert all(e.safety == "safe" for e in result.plan.edits)
            rules = {e.rule for e in result.plan.edits}
            loaded = load_target(str(path))
            report = check(loaded.model, *loaded.args, device="cuda", dtype="float16", calibrate=True,
                           data=calibration_data(loaded), **loaded.kwargs)     # as check --calibrate
            left = [f for f in report.findings if f.rule in rules and f.severity != "info"]
            assert not left, f"{path.name}: {[f.message for f in left]}"
            out, _ = _fp32_out(path, state)
            assert all(torch.equal(a, b) for a, b in zip(_flat(out), _flat(ref))), path.name
        else:
            assert path.read_text() == before
    assert {"mask_fill.py", "mask_fill_crash.py", "char_transformer.py"} <= set(fixed_any)
    # The LSTM runs under CUDA fp16 (the simulation covers this CPU's missing oneDNN kernel): nothing to fix.
    assert "lstm_forecaster.py" not in fixed_any


ODD = '''"""A mask that fp16 cannot hold, in code with comments and odd formatting."""
import torch, torch.nn as nn
import torch.nn.functional as F


class Attn( nn.Module ):
    def __init__(self, d=16):
        super().__init__(); self.qkv = nn.Linear(d, 3*d)   # fused projection

    def forward(self, x, mask):
        q,k,v = self.qkv( x ).chunk(3, -1)
        # scores, unscaled on purpose
        s = (q @ k.transpose(-2,-1))
        s = s.masked_fill(  ~mask,
                          -1e9 )   # the constant fp16 cannot hold
        return F.softmax(s, -1) @ v   # ampaudit: ignore


def build_model():
    torch.manual_seed(0); return Attn()


def example_inputs():
    torch.manual_seed(1); m = torch.ones(2, 8, 8, dtype=torch.bool); m[:, 2] = False
    return (torch.randn(2, 8, 16), m)
'''


def test_diff_keeps_comments_and_formatting(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    result = fix_source(str(path), device="cuda", dtype="float16")
    new = result.changed[str(path.resolve())]
    old_lines, new_lines = ODD.splitlines(), new.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines) if a != b]
    assert len(old_lines) == len(new_lines)
    assert changed == [("        s = s.masked_fill(  ~mask,", "        s = s.float().masked_fill(  ~mask,")]
    assert "-1e9 )   # the constant fp16 cannot hold" in new and "# ampaudit: ignore" in new
    diff = result.diff(tmp_path)
    body = diff.splitlines()[2:]
    assert diff.startswith("--- a/odd.py\n+++ b/odd.py\n")
    assert sum(ln.startswith("-") for ln in body) == 1 and sum(ln.startswith("+") for ln in body) == 1


def test_ignore_comment_is_read_one_way_by_check_and_fix():
    from ampaudit.rules.engine import ignores

    assert ignores("x = 1  # ampaudit: ignore") and ignores("x  #AmpAudit:ignore", "AMP401")
    assert ignores("x  # ampaudit: ignore[AMP101, constant-overflows-dtype]", "AMP401", "constant-overflows-dtype")
    assert not ignores("x  # ampaudit: ignore[AMP101]", "AMP401", "constant-overflows-dtype")
    assert not ignores("x  # ampaudit ignores nothing here", "AMP401")


@pytest.mark.parametrize("comment, edited", [("ignore[AMP101]", True), ("ignore[constant-overflows-dtype]", False),
                                             ("ignore", False)])
def test_fix_leaves_a_line_only_when_its_comment_ignores_the_rule(tmp_path, comment, edited):
    # On the line the finding and the edit are on: a comment that ignores another rule does not stop the edit.
    path = tmp_path / "odd.py"
    path.write_text(ODD.replace("s = s.masked_fill(  ~mask,", f"s = s.masked_fill(  ~mask,  # ampaudit: {comment}"))
    result = fix_source(str(path), device="cuda", dtype="float16", select=["AMP401"])
    assert bool(result.changed) == edited, result.to_text()
    assert [e.line for e in result.plan.edits] == ([14] if edited else [])


@pytest.mark.slow     # three CLI runs: ~2 s
def test_cli_diff_write_and_exit_codes(tmp_path):
    from typer.testing import CliRunner

    import ampaudit.cli.commands  # noqa: F401  registers the commands
    from ampaudit.cli.app import app

    path = tmp_path / "odd.py"
    path.write_text(ODD)
    runner = CliRunner()
    r = runner.invoke(app, ["fix", str(path), "--diff"])
    assert r.exit_code == 1 and "+        s = s.float().masked_fill(" in r.stdout and path.read_text() == ODD
    r = runner.invoke(app, ["fix", str(path), "--write", "--format", "json"])
    assert r.exit_code == 0, r.output
    import json

    data = json.loads(r.stdout)
    assert data["written"] and data["edits"][0]["rule"] == "AMP401" and data["edits"][0]["safety"] == "safe"
    assert data["verification"]["ok"] and data["edits"][0]["verified"]["fp32_bitwise"]
    assert path.read_text() != ODD
    r = runner.invoke(app, ["fix", str(path), "--diff"])      # fixed: nothing more to change
    assert r.exit_code == 0 and r.stdout == ""
    r = runner.invoke(app, ["fix", str(path)])
    assert r.exit_code == 2 and "--output DIR" in r.output
    r = runner.invoke(app, ["fix", str(path), "--diff", "--write"])
    assert r.exit_code == 2


def test_unsafe_fix_needs_the_flag():
    before = HERE / "source_fix" / "AMP103" / "before.py"
    s = _fix_settings(before)
    safe = _run(before, {**s, "unsafe": False}, select=["AMP103"])
    assert not safe.changed and [e.rule for e in safe.plan.skipped_unsafe] == ["AMP103"]


def test_library_lines_are_refused_with_an_alternative(tmp_path):
    """A finding whose line is in an installed package is never edited; the summary says what to do."""
    from ampaudit.sourcefix.driver import is_library_file

    assert is_library_file(torch.nn.functional.__file__)
    assert not is_library_file(tmp_path / "model.py")
