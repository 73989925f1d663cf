"""A static finding on a model that lives in an installed library names the library's own line, marked as such,
with its module path, whatever capture ran; reports annotate only the user's files and fix never edits the
library (docs/locations.md). A user's model keeps its own line, as before."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.findings import Report
from ampaudit.report.github import to_github
from ampaudit.report.sarif import to_sarif
from ampaudit.rules.loader import load_rules

NET = '''
import torch
from torch import nn

from tinyhelpers.ops import squash


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 100)

    def forward(self, x):
        h = self.fc(x)   # FC_LINE
        return squash(h)   # SQUASH_LINE
'''

# Another library the model calls into: the softmax runs here, but the line named is the model package's call.
OPS = '''
import torch


def squash(h):
    return torch.softmax(h, -1)
'''


def _line(text: str, mark: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if mark in line)


@pytest.fixture
def tinymodels(installed_library, monkeypatch):
    """``tinymodels.models.net`` (and the ``tinyhelpers`` it imports), installed in a site-packages folder."""
    site = installed_library.folder
    for rel, text in {"tinymodels/__init__.py": "", "tinymodels/models/__init__.py": "",
                      "tinymodels/models/net.py": NET, "tinyhelpers/__init__.py": "",
                      "tinyhelpers/ops.py": OPS}.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    for name in [n for n in sys.modules if n.split(".")[0] in ("tinymodels", "tinyhelpers")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("tinymodels.models.net")
    yield module
    for name in [n for n in sys.modules if n.split(".")[0] in ("tinymodels", "tinyhelpers")]:
        del sys.modules[name]


FILE = "tinymodels/models/net.py"
SCHEMA = Path(__file__).parent / "assets" / "sarif-schema-2.1.0.json"    # the official SARIF 2.1.0 schema


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_every_capture_names_the_models_own_library_line(tinymodels, mode):
    report = ampaudit.check(tinymodels.Net(), torch.randn(4, 64), device="cuda", capture_mode=mode)
    assert report.capture == mode and report.findings
    assert all(f.location == {"file": FILE, "line": f.location["line"], "library": True} for f in report.findings)
    where = {(f.rule, f.module): f.location["line"] for f in report.findings}
    assert where[("AMP101", "fc")] == _line(NET, "FC_LINE")
    # The softmax runs in tinyhelpers; the model's package (tinymodels) owns the line that calls it.
    assert where[("AMP201", "")] == _line(NET, "SQUASH_LINE")
    assert next(f for f in report.findings if f.rule == "AMP101").code == "h = self.fc(x)   # FC_LINE"


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2   # the user's line: what the user can change


def test_a_users_model_around_a_library_model_keeps_the_users_line(tinymodels):
    report = ampaudit.check(Wrapper(tinymodels.Net()), torch.randn(4, 64), device="cuda", capture_mode="fx")
    line = inspect.getsourcelines(Wrapper.forward)[1] + 1
    assert report.findings and {f.module for f in report.findings} >= {"inner.fc"}
    assert all(f.location == {"file": __file__, "line": line} for f in report.findings)


class Own(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 100)

    def forward(self, x):
        return torch.softmax(self.fc(x), -1)


@pytest.mark.parametrize("mode", ["fx", "export", "dispatch"])
def test_a_users_own_model_has_its_plain_location(mode, tmp_path):
    report = ampaudit.check(Own(), torch.randn(4, 64), device="cuda", capture_mode=mode, base_dir=tmp_path)
    line = inspect.getsourcelines(Own.forward)[1] + 1
    assert report.findings and all(f.location == {"file": __file__, "line": line} for f in report.findings)


def test_a_torch_only_model_still_has_no_line():
    report = ampaudit.check(nn.Linear(64, 100), torch.randn(4, 64), device="cuda", capture_mode="export")
    assert report.findings and all(f.location is None for f in report.findings)


def test_a_virtualenvs_site_packages_is_a_library_not_the_users(tmp_path, monkeypatch):
    # A virtualenv's site-packages lies outside the standard library's folder; it is still no file of the user's
    # (a wrapped helper of timm's there is not a user function), whether it is this interpreter's or another's.
    import ampaudit.user_code as user_code
    from ampaudit.sourcefix import driver

    site = tmp_path / "venv" / "lib" / "site-packages"
    other = tmp_path / "other" / "lib" / "python3" / "dist-packages"
    for folder in (site, other):
        (folder / "pkg").mkdir(parents=True)
        (folder / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "mine.py").write_text("x = 1\n")
    monkeypatch.setattr(user_code, "library_dirs", lambda: (str(site.resolve()) + os.sep,))
    user_code.clear_caches()
    try:
        path = str(site / "pkg" / "mod.py")
        assert not user_code.is_user_file(path) and user_code.is_library_file(path)
        elsewhere = str(other / "pkg" / "mod.py")      # a site folder of no interpreter running here
        assert not user_code.is_user_file(elsewhere) and user_code.library_path(elsewhere) == "pkg/mod.py"
        assert user_code.frame_kind(elsewhere) == (user_code.LIBRARY, "pkg")
        # fix asks the same owner: never a library's file, nor torch's; the user's own file it edits.
        assert driver.is_library_file(path) and driver.is_library_file(elsewhere)
        assert driver.is_library_file(torch.nn.functional.__file__)
        assert not driver.is_library_file(tmp_path / "mine.py")
        assert user_code.frame_kind(path) == (user_code.LIBRARY, "pkg")
        assert user_code.library_path(path) == "pkg/mod.py"
        assert user_code.frame_kind(__file__) == (user_code.USER, None)
        assert user_code.frame_kind(torch.nn.functional.__file__) == (None, None)
    finally:
        user_code.clear_caches()


HOT_OPS = '''
def squash(h):
    return h * 1e5      # HOT_LINE: past fp16's max
'''


def test_the_runtime_locator_names_the_models_own_package_like_the_static_audit(tinymodels, monkeypatch):
    # The inf arises in tinyhelpers (a library the model calls); the line named is the model package's call, as
    # capture.source_lines names it statically.
    from ampaudit.runtime.locate import locate_nonfinite
    from ampaudit.runtime.module_stack import model_location

    helper = Path(sys.modules["tinyhelpers.ops"].__file__)
    net = tinymodels.__file__
    frames = [(str(helper), 3), (net, _line(NET, "SQUASH_LINE"))]
    assert model_location(frames) == f"{helper}:3"
    assert model_location(frames, packages=frozenset({"tinymodels"})) == f"{net}:{_line(NET, 'SQUASH_LINE')}"
    helper.write_text(HOT_OPS)
    for name in [n for n in sys.modules if n.split(".")[0] in ("tinymodels", "tinyhelpers")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("tinymodels.models.net")
    torch.manual_seed(0)
    found = locate_nonfinite(module.Net(), (torch.randn(4, 64) * 10,), dtype=torch.float16)
    assert found and found[0]["kind"] == "inf" and found[0]["source"].endswith(f"net.py:{_line(NET, 'SQUASH_LINE')}")


@pytest.fixture
def library_report(tinymodels, tmp_path) -> Report:
    return ampaudit.check(tinymodels.Net(), torch.randn(4, 64), device="cuda", capture_mode="fx",
                          base_dir=tmp_path)


def test_the_table_and_json_mark_the_library_line(library_report):
    from rich.console import Console

    from ampaudit.report.console import render_report
    from ampaudit.testing import format_findings

    console = Console(record=True, width=200)
    render_report(library_report, console)
    # The table names the package and the file (the full path would widen its column and wrap every message),
    # every line here a library's, so its header says "(library)" once; JSON and the plain-text findings keep the
    # full path below site-packages.
    shown = console.export_text()
    assert f"tinymodels/.../net.py:{_line(NET, 'FC_LINE')}" in shown and FILE not in shown
    assert "where (library)" in shown and shown.count("(library)") == 1
    assert f"{FILE}:{_line(NET, 'FC_LINE')} (library)" in format_findings(library_report.findings, width=200)
    data = json.loads(json.dumps(library_report.to_dict()))
    assert data["version"] == "1.3"
    assert {json.dumps(f["location"], sort_keys=True) for f in data["findings"]} >= {
        json.dumps({"file": FILE, "line": _line(NET, "FC_LINE"), "library": True}, sort_keys=True)}


def test_sarif_and_github_annotate_no_library_file(library_report):
    doc = to_sarif(library_report, load_rules([]))
    results = doc["runs"][0]["results"]
    assert results and all("physicalLocation" not in loc for r in results for loc in r["locations"])
    fc = next(r for r in results if r["properties"]["module"] == "fc")
    assert fc["locations"] == [{"logicalLocations": [{"fullyQualifiedName": "fc", "kind": "module"}]}]
    assert fc["properties"]["libraryLocation"]["file"] == FILE
    assert f"{FILE}:{_line(NET, 'FC_LINE')} (library)" in fc["message"]["text"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    lines = to_github(library_report).splitlines()
    assert lines and not any("file=" in line or "line=" in line for line in lines)
    assert any(f"{FILE}:{_line(NET, 'FC_LINE')} (library)" in line for line in lines)


def test_fix_refuses_the_library_line_and_leaves_it_alone(tinymodels, tmp_path):
    from ampaudit.sourcefix import fix_source

    model_file = tmp_path / "model.py"
    model_file.write_text(textwrap.dedent("""
        import torch
        from tinymodels.models.net import Net

        def build_model():
            return Net()

        def example_inputs():
            return (torch.randn(4, 64),)
    """))
    library_file = tmp_path / "site-packages" / FILE     # installed_library's folder
    before = library_file.read_text()
    result = fix_source(str(model_file), device="cuda", dtype="float16", verify=False)
    assert not result.changed and library_file.read_text() == before
    refused = [r for r in result.plan.refusals if r.rule == "AMP101"]
    assert refused and all(r.file == FILE and "installed package" in r.reason for r in refused)
    # What is true of a library's Linear: the module-tree rewrite pads it (its library has no option for it).
    assert all(r.instead == "ampaudit fix --pad -o DIR" for r in refused)
    assert any(f"not fixed: AMP101 {FILE}:{_line(NET, 'FC_LINE')}" in line for line in result.lines())


def test_a_measured_findings_library_source_is_marked_too(tinymodels):
    # Calibration's locators report "file:line" (module_stack.model_location); the finding's location is built
    # from it by the same rule as a static one's.
    from ampaudit.rules.engine import location_of
    from ampaudit.rules.matchers.calibrated import _source

    loc = location_of(_source(f"{tinymodels.__file__}:{_line(NET, 'FC_LINE')}"))
    assert loc == {"file": FILE, "line": _line(NET, "FC_LINE"), "library": True}
    assert location_of(_source(f"{__file__}:3")) == {"file": __file__, "line": 3}
