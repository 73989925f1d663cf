"""AmpProp: example inputs that do not fit the forward are an InputError; ops without a fake kernel are not."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.errors import InputError


class ViewNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).view(3, -1)   # 2x8 cannot be viewed as 3 rows


class NoKernelNet(nn.Module):
    """nonzero has no fake kernel, .numpy() raises on a fake tensor: shapes after them are unknown, not wrong."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        keep = torch.nonzero(h[:, 0] > -1e9).squeeze(1)
        h.detach().numpy()
        return h[keep]


def test_linear_fed_the_wrong_width_names_the_op_and_the_kernels_message():
    with pytest.raises(InputError) as info:
        ampaudit.check(nn.Linear(4, 4), torch.randn(2, 7), device="cpu", dtype="bfloat16")
    line = info.value.one_line()
    assert line.startswith("example inputs do not fit the forward: linear")
    assert "mat1 and mat2 shapes cannot be multiplied (2x7 and 4x4)" in line and "example_inputs()" in line


def test_mismatch_inside_forward_names_the_users_line():
    with pytest.raises(InputError) as info:
        ampaudit.check(ViewNet(), torch.randn(2, 8))
    assert "view (test_analysis_amp_prop.py:18)" in info.value.one_line()
    assert "is invalid for input of size 16" in info.value.one_line()


def test_meta_model_mismatch_is_an_input_error_too():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(InputError, match="do not fit the forward: linear"):
        ampaudit.check(model, torch.randn(2, 7))


class StrayCpuParamNet(nn.Module):
    """Built under a meta device context, but its first parameter is made by torch.Tensor(), which stays on CPU."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.Tensor(8).uniform_())   # unused by forward, as a masking embedding at eval
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_meta_model_with_one_stray_cpu_parameter_is_audited_on_meta(mode):
    with torch.device("meta"):
        model = StrayCpuParamNet()
    assert model.spare.device.type == "cpu" and model.fc.weight.is_meta
    report = ampaudit.check(model, torch.randn(2, 8, device="meta"), capture_mode=mode)
    assert report.capture == mode


def test_ops_without_a_fake_kernel_leave_shapes_unknown_without_an_error():
    report = ampaudit.check(NoKernelNet(), torch.randn(8, 8), capture_mode="fx")
    assert any("shapes unknown" in n for n in report.notes), report.notes


def test_mismatch_check_leaves_batchnorm_statistics_alone():
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(5, 4))
    before = model[1].running_mean.clone()
    with pytest.raises(InputError, match="linear"):
        ampaudit.check(model, torch.randn(2, 5) + 3)
    assert torch.equal(model[1].running_mean, before)


def test_an_export_graphs_autocast_region_is_not_taken_for_inputs_that_do_not_fit():
    # timm's EfficientViT turns autocast off inside its attention: export records wrap_with_autocast, whose baked
    # dtypes mismatch when that one op is rerun alone; the real forward runs fine, so it is no InputError.
    class Att(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.q(x)
            with torch.autocast("cpu", enabled=False):
                h = h.float()
                return (h @ h.transpose(-1, -2)).softmax(-1) @ h

    import ampaudit

    report = ampaudit.check(Att(), torch.randn(2, 8, 16), device="cuda", capture_mode="export")
    assert report.capture == "export"
