"""Mixed-precision safety as part of a test suite (pip install ampaudit; the pytest plugin loads itself).

Project defaults for the `amp_audit` fixture come from [tool.ampaudit] in pyproject.toml, e.g.

    [tool.ampaudit]
    device = "cuda"
    dtype = "bfloat16"
    fail-on = "warning"
    ignore = ["AMP403"]
"""
import torch
import torch.nn as nn

from ampaudit.testing import assert_amp_safe


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.head = nn.Linear(128, 16)

    def forward(self, x):
        return self.head(self.body(x))


def test_classifier_is_fp16_safe():
    # Fails with a table of findings (rule, module, source line, fix); passes silently when clean.
    assert_amp_safe(Classifier(), torch.randn(64, 64), device="cuda", dtype="float16")


def test_classifier_with_project_defaults(amp_audit):
    # Same check with the defaults of [tool.ampaudit]; calibrate=True also runs the model on the inputs.
    amp_audit(Classifier(), torch.randn(64, 64), calibrate=True)
