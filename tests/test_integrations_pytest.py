"""The pytest integration: assert_amp_safe and the amp_audit fixture, run inside pytest's own pytester."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from ampaudit.errors import UsageError
from ampaudit.testing import AmpSafetyError, assert_amp_safe, format_findings

pytest_plugins = ("pytester",)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytest" / "test_amp_safety.py"

MODELS = '''
import torch, torch.nn as nn

class Clean(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(64, 128); self.fc2 = nn.Linear(128, 16)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

class Misaligned(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(64, 50); self.fc2 = nn.Linear(50, 16)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
'''


class Misaligned(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 50)
        self.fc2 = nn.Linear(50, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.slow
def test_assert_amp_safe_fails_with_a_table_naming_rule_module_and_line():
    assert_amp_safe(Misaligned(), torch.randn(8, 64))      # speed findings alone do not fail the safety gate
    with pytest.raises(AmpSafetyError) as info:
        assert_amp_safe(Misaligned(), torch.randn(8, 64), speed=True)
    text = str(info.value)
    assert "Misaligned is not mixed-precision fast for cuda float16 autocast" in text
    assert "AMP101 linear-dims-misaligned" in text and "fc1" in text and "fc2" in text
    assert "test_integrations_pytest.py:" in text          # the source line of the layer
    assert {f.rule for f in info.value.failing} == {"AMP101"}
    assert isinstance(info.value, AssertionError)


def test_assert_amp_safe_respects_fail_on_and_ignore():
    report = assert_amp_safe(Misaligned(), torch.randn(8, 64), fail_on="error")
    assert report.findings and report.worst() == "warning"      # found, but below the bar
    assert assert_amp_safe(Misaligned(), torch.randn(8, 64), ignore=["AMP101"]).findings == []
    with pytest.raises(UsageError, match="unknown fail_on"):
        assert_amp_safe(Misaligned(), torch.randn(8, 64), fail_on="sometimes")


def test_format_findings_is_plain_text():
    report = assert_amp_safe(Misaligned(), torch.randn(8, 64), fail_on="never")
    table = format_findings(report.findings)
    assert "\x1b[" not in table                                  # no colour codes in a test failure
    assert table.splitlines()[0].split()[:4] == ["severity", "rule", "module", "where"]


# Plugins of this environment that the inner runs do not need (unknown names are ignored by -p no:).
QUIET = ("-q", "-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:hypothesispytest", "-p", "no:anyio")


def test_inside_pytest(pytester: pytest.Pytester):
    """One inner run: a clean model passes silently, a bad one fails with the table, the fixture reads
    [tool.ampaudit] from the nearest pyproject.toml, and a bad [tool.ampaudit] is a setup error."""
    pytester.makepyfile(amp_models=MODELS)
    pytester.makepyfile(test_clean='''
import torch
from ampaudit.testing import assert_amp_safe
from amp_models import Clean

def test_clean():
    assert_amp_safe(Clean(), torch.randn(8, 64))
''')
    pytester.makepyfile(test_bad='''
import torch
from ampaudit.testing import assert_amp_safe
from amp_models import Misaligned

def test_bad():
    assert_amp_safe(Misaligned(), torch.randn(8, 64), speed=True)
''')
    sub = pytester.mkpydir("proj")
    (sub / "__init__.py").unlink()
    (sub / "proj_models.py").write_text(MODELS)
    (sub / "pyproject.toml").write_text('[tool.ampaudit]\ndevice = "cpu"\ndtype = "bfloat16"\nignore = ["AMP101"]\n')
    (sub / "test_fixture.py").write_text('''
import torch
from proj_models import Clean, Misaligned

def test_defaults(amp_audit):
    assert amp_audit.defaults == {"device": "cpu", "dtype": "bfloat16", "ignore": ["AMP101"]}
    report = amp_audit(Misaligned(), torch.randn(8, 64))          # AMP101 ignored by the project
    assert report.policy == {"device": "cpu", "dtype": "bfloat16"}

def test_override_fails(amp_audit):
    amp_audit(Misaligned(), torch.randn(8, 64), ignore=[], fail_on="info", speed=True)   # per-call options win

def test_check_never_fails(amp_audit):
    report = amp_audit.check(Misaligned(), torch.randn(8, 64), ignore=[])
    assert {f.rule for f in report.findings} == {"AMP101"}
''')
    # the example under examples/pytest/, as a user would run it
    shutil.copy(EXAMPLE, pytester.path / "test_example_amp_safety.py")
    bad_cfg = pytester.mkdir("badcfg")
    (bad_cfg / "pyproject.toml").write_text('[tool.ampaudit]\nfail_when = "warning"\n')
    (bad_cfg / "test_cfg.py").write_text("def test_cfg(amp_audit):\n    pass\n")

    result = pytester.runpytest_inprocess(*QUIET)
    result.assert_outcomes(passed=5, failed=2, errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*AmpSafetyError: Misaligned is not mixed-precision fast*",
                                 "*AMP101 linear-dims-misaligned*fc1*amp_models.py:*out_features = 50*"])
    assert "FAILED test_bad.py::test_bad" in out and "FAILED proj/test_fixture.py::test_override_fails" in out
    assert "ERROR badcfg/test_cfg.py::test_cfg" in out and "unknown key 'fail_when'" in out
    # __tracebackhide__: the failure points at the test's line, not into ampaudit
    assert "ampaudit/testing.py" not in out


@pytest.mark.slow
def test_plugin_is_registered_and_does_not_import_torch(pytester: pytest.Pytester):
    pytester.makepyfile(test_light='''
import sys

def test_light(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("ampaudit")
    assert "torch" not in sys.modules, "the ampaudit plugin imported torch at start-up"
''')
    result = pytester.runpytest_subprocess(*QUIET)
    result.assert_outcomes(passed=1)
