"""Each rule fires on a model that should trigger it and stays silent on one that should not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampaudit


class Fn(nn.Module):
    """Wraps a function of the input so each case is one line; `inner` owns the op."""

    def __init__(self, fn, *mods):
        super().__init__()
        self.fn = fn
        self.inner = nn.ModuleList(mods)

    def forward(self, x):
        return self.fn(self, x)


class Proj(nn.Module):
    """Linear(16->16) then fn: puts the input in the low dtype, as real models do."""

    def __init__(self, fn):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.proj(x))


def hits(model, *inputs, device="cpu", dtype="float16", rule=None):
    report = ampaudit.check(model, *inputs, device=device, dtype=dtype)
    return [(f.rule, f.severity, f.module) for f in report.findings if rule is None or f.rule == rule]


X16 = torch.randn(4, 16)
SEQ = torch.randn(2, 4096, 16)


def box(h, fp32=False, positive=True):
    """A sliding-window sum from a cumsum difference (window 8 over 4096 steps)."""
    terms = F.softplus(h) if positive else h
    c = (terms.float() if fp32 else terms).cumsum(1)
    return c[:, 8:] - c[:, :-8]

CASES = [
    # rule, should-fire model+inputs, should-not model+inputs, device, expected severity
    ("AMP101", (nn.Linear(30, 64), torch.randn(4, 30)), (nn.Linear(32, 64), torch.randn(4, 32)), "cuda", "warning"),
    ("AMP102", (nn.Sequential(nn.Conv2d(8, 30, 3), nn.Conv2d(30, 64, 3)), torch.randn(2, 8, 8, 8)),
     (nn.Sequential(nn.Conv2d(8, 32, 3), nn.Conv2d(32, 64, 3)), torch.randn(2, 8, 8, 8)), "cuda", "warning"),
    # The image's 3 channels: cuDNN pads them, and they are the data's.
    ("AMP102", (nn.Conv2d(3, 64, 3), torch.randn(2, 3, 8, 8)), (nn.Conv2d(8, 64, 3), torch.randn(2, 8, 8, 8)), "cuda", "info"),
    # A lookup is not a GEMM: the GEMMs around it are AMP101's.
    ("AMP103", (nn.Embedding(1001, 64), torch.zeros(2, 5, dtype=torch.long)),
     (nn.Embedding(1024, 64), torch.zeros(2, 5, dtype=torch.long)), "cuda", "info"),
    # Under 2% of the model's GEMM work: an info.
    ("AMP101", (nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 10)), torch.randn(4, 512)),
     (nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 16)), torch.randn(4, 512)), "cuda", "info"),
    ("AMP104", (Fn(lambda s, x: x @ x.transpose(-1, -2)), torch.randn(4, 10, 30)),
     (Fn(lambda s, x: x @ x.transpose(-1, -2)), torch.randn(4, 16, 32)), "cuda", "warning"),
    ("AMP105", (nn.LSTM(16, 50, batch_first=True), torch.randn(2, 5, 16)),
     (nn.LSTM(16, 64, batch_first=True), torch.randn(2, 5, 16)), "cuda", "warning"),
    # Softmax kernels accumulate in fp32 on every device: low-precision input is an info, not a hazard.
    ("AMP201", (Proj(lambda h: F.softmax(h, -1)), X16), (Proj(lambda h: F.softmax(h.float(), -1)), X16), "cpu", "info"),
    ("AMP201", (Proj(lambda h: F.softmax(h, -1)), X16), (nn.Sequential(nn.Softmax(-1)), X16), "cuda", "info"),
    ("AMP202", (Proj(lambda h: torch.exp(h)), X16), (Proj(lambda h: torch.exp(h.float())), X16), "cpu", "warning"),
    ("AMP203", (Proj(lambda h: h.sum()), torch.randn(6000, 16)), (Proj(lambda h: h.float().sum()), torch.randn(6000, 16)), "cpu", "warning"),
    # 64 terms pass 65504 only if they average above 1024: an info; from 4096 terms on, a warning.
    ("AMP203", (Proj(lambda h: h.sum()), X16), (Proj(lambda h: h.float().sum()), X16), "cpu", "info"),
    ("AMP203", (Proj(lambda h: h.mean(-1)), X16), (Proj(lambda h: h.float().mean(-1)), X16), "cpu", "info"),
    ("AMP203", (Proj(lambda h: h.var(-1)), X16), (Proj(lambda h: h.float().var(-1)), X16), "cuda", "warning"),
    ("AMP204", (Proj(lambda h: F.cosine_similarity(h, h)), X16), (Proj(lambda h: F.mse_loss(h, h)), X16), "cpu", "info"),
    ("AMP205", (Proj(lambda h: F.binary_cross_entropy(torch.sigmoid(h), torch.zeros(4, 16))), X16),
     (Proj(lambda h: F.binary_cross_entropy_with_logits(h, torch.zeros(4, 16))), X16), "cuda", "error"),
    # fp32 parameters: the kernel keeps the statistics in fp32 (info); a model cast to half has fp16 ones (warning).
    ("AMP301", (nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), X16), (nn.Sequential(nn.LayerNorm(16)), X16), "cpu", "info"),
    ("AMP301", (nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)), X16), (nn.Sequential(nn.BatchNorm1d(16)), X16), "cuda", "info"),
    ("AMP301", (nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).half(), X16.half()),
     (nn.Sequential(nn.BatchNorm1d(16)), X16), "cuda", "warning"),
    # LayerNorm keeps no running statistics: with half weights its kernel still accumulates in fp32.
    ("AMP301", (nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).half(), X16.half()),
     (nn.Sequential(nn.LayerNorm(16)), X16), "cpu", "info"),
    ("AMP302", (Proj(lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)), X16),
     (Proj(lambda h: h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)), X16), "cpu", "warning"),
    ("AMP401", (Proj(lambda h: h.masked_fill(h > 0, -1e9)), X16), (Proj(lambda h: h.masked_fill(h > 0, -1e4)), X16), "cuda", "error"),
    ("AMP401", (Proj(lambda h: h + torch.finfo(torch.float32).min), X16), (Proj(lambda h: h + torch.finfo(torch.float16).min), X16), "cuda", "error"),
    ("AMP402", (Proj(lambda h: h / (h.abs() + 1e-8)), X16), (Proj(lambda h: h / (h.abs() + 1e-3)), X16), "cuda", "warning"),
    ("AMP403", (Proj(lambda h: h + 1e-6), X16), (Proj(lambda h: h + 1e-3), X16), "cuda", "info"),
    # Default arguments are constants too: F.normalize's eps=1e-12 clamps an fp16 norm on CPU.
    ("AMP402", (Proj(lambda h: F.normalize(h, dim=-1)), X16), (Proj(lambda h: F.normalize(h, dim=-1, eps=1e-4)), X16),
     "cpu", "warning"),
    ("AMP402", (Proj(lambda h: F.cosine_similarity(h, h)), X16), (Proj(lambda h: F.cosine_similarity(h.float(), h.float())), X16),
     "cpu", "warning"),
    ("AMP403", (Proj(lambda h: F.pairwise_distance(h, h)), X16), (Proj(lambda h: F.pairwise_distance(h, h, eps=1e-4)), X16),
     "cpu", "info"),
    # Integers past 2048 held in fp16: created there, cast there, or taken by an op computing there.
    ("AMP404", (Proj(lambda h: h * torch.arange(4000, dtype=h.dtype)[-16:]), X16),
     (Proj(lambda h: h * torch.arange(4000, dtype=h.dtype)[:16]), X16), "cpu", "warning"),
    ("AMP404", (Proj(lambda h: h + torch.arange(3000).type_as(h)[-16:]), X16),
     (Proj(lambda h: h + torch.arange(3000).float()[-16:]), X16), "cuda", "warning"),
    ("AMP404", (Proj(lambda h: h + torch.arange(3000)[-16:]), X16),
     (Proj(lambda h: h + torch.arange(3000)[:16]), X16), "cpu", "warning"),
    ("AMP404", (Proj(lambda h: h / torch.arange(1, 4001, dtype=h.dtype)[-16:]), X16),
     (Proj(lambda h: h / torch.arange(1, 17, dtype=h.dtype)), X16), "cpu", "info"),
    # Window sums from a low-precision cumsum: a warning when one-sign terms and the window prove the error.
    # An op on no autocast list that meets the lowered activation and an fp32 tensor, and whose kernel wants one.
    ("AMP207", (Proj(lambda h: torch.zeros(4, 16).index_add_(0, torch.arange(4), h)), X16),
     (Proj(lambda h: torch.zeros(4, 16, dtype=h.dtype).index_add_(0, torch.arange(4), h)), X16), "cuda", "error"),
    ("AMP207", (Proj(lambda h: torch.zeros(4, 16).scatter_add(0, torch.zeros(4, 16, dtype=torch.long), h)), X16),
     (Proj(lambda h: torch.zeros(4, 16) + h), X16), "cpu", "error"),
    # cross's meta kernel lets the dtypes through; the real kernel on zeros has the last word.
    ("AMP207", (Proj(lambda h: torch.cross(h[:, :3], torch.ones(4, 3), dim=1)), X16),
     (Proj(lambda h: torch.cross(h[:, :3], torch.ones(4, 3, dtype=h.dtype), dim=1)), X16), "cpu", "error"),
    ("AMP206", (Proj(box), SEQ), (Proj(lambda h: box(h, fp32=True)), SEQ), "cpu", "warning"),
    ("AMP206", (Proj(lambda h: box(h, positive=False)), SEQ), (Proj(lambda h: box(h, fp32=True, positive=False)), SEQ),
     "cpu", "info"),
]


@pytest.mark.parametrize("rule, fire, silent, device, severity", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_rule_fires_and_stays_silent(rule, fire, silent, device, severity):
    got = hits(*fire, device=device, rule=rule)
    assert got, f"{rule} did not fire"
    assert got[0][1] == severity
    assert hits(*silent, device=device, rule=rule) == [], f"{rule} fired on the clean variant"


def test_alignment_multiple_is_16_for_fp8():
    m, x = nn.Linear(24, 64), torch.randn(4, 24)
    assert hits(m, x, device="cuda", dtype="float16", rule="AMP101") == []
    assert hits(m, x, device="cuda", dtype="float8", rule="AMP101")


@pytest.mark.parametrize("shifted", [lambda h: h - h.amax(-1, keepdim=True), lambda h: h - h.max(-1, keepdim=True)[0],
                                     lambda h: h - torch.max(h)], ids=["amax", "max_dim", "max"])
def test_exp_shifted_by_its_max_cannot_overflow(shifted):
    """The softmax shift exp(x - max x) is at most 1: the stored result is low, not its range (an info); exp of
    the same scores unshifted, or shifted by another tensor's max, keeps the overflow warning."""
    got = hits(Proj(lambda h: torch.exp(shifted(h))), X16, device="cpu", rule="AMP202")
    assert [sev for _, sev, _ in got] == ["info"], got
    other = hits(Proj(lambda h: torch.exp(h - (2 * h).amax(-1, keepdim=True))), X16, device="cpu", rule="AMP202")
    assert [sev for _, sev, _ in other] == ["warning"], other


def test_depthwise_conv_is_not_a_gemm():
    assert hits(nn.Conv2d(30, 30, 3, groups=30), torch.randn(1, 30, 8, 8), device="cuda", rule="AMP102") == []


def test_bf16_holds_small_eps_but_not_float32_min():
    eps = Proj(lambda h: h / (h.abs() + 1e-8))
    assert hits(eps, X16, device="cuda", dtype="bfloat16", rule="AMP402") == []
    mask = Proj(lambda h: h + torch.finfo(torch.float32).min)
    assert hits(mask, X16, device="cuda", dtype="bfloat16", rule="AMP401")


def test_batchnorm_buffer_out_of_range_and_meta_model_silent():
    bn = nn.Sequential(nn.Conv1d(8, 8, 1), nn.BatchNorm1d(8)).eval()
    bn[1].running_var.fill_(1e6)
    assert hits(bn, torch.randn(2, 8, 4), device="cuda", rule="AMP303") == [("AMP303", "warning", "1")]
    assert hits(bn, torch.randn(2, 8, 4), device="cuda", dtype="bfloat16", rule="AMP303") == []
    with torch.device("meta"):
        meta = nn.Sequential(nn.Conv1d(8, 8, 1), nn.BatchNorm1d(8))
    assert hits(meta, torch.randn(2, 8, 4), device="cuda", rule="AMP303") == []


def test_module_is_the_one_whose_code_runs_the_op():
    class Inner(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.block = nn.Sequential(Inner())

        def forward(self, x):
            return self.block(self.fc(x)).sum()

    found = hits(Outer(), X16, device="cpu")
    assert ("AMP202", "warning", "block.0") in found
    assert ("AMP203", "info", "") in found            # a sum of 64 terms: the top module's own op


@pytest.mark.parametrize("name, device, rule, module", [
    ("mask_fill", "cpu", "AMP401", "attn"),
    ("mask_fill_crash", "cpu", "AMP401", "attn"),
    ("gelu_cube", "cpu", "AMP202", "mlp.act"),
    ("cumsum_pool", "cpu", "AMP203", "pool"),
    ("bn_running_var", "cuda", "AMP303", "bn"),
])
def test_planted_culprit_found(planted, name, device, rule, module):
    m = planted(name)
    report = ampaudit.check(m.build_model(), *m.example_inputs(), device=device)
    assert any(f.rule == rule and f.module == module for f in report.findings), report.to_dict()["findings"]
    assert set(m.EXPECT["families"]) & {f.family for f in report.findings}


def test_planted_misaligned_dims(planted):
    m = planted("misaligned_mlp")
    report = ampaudit.check(m.build_model(), *m.example_inputs())
    flagged = {(f.module, f.details["value"]) for f in report.findings if f.family == "alignment"}
    for module, value in m.EXPECT["misaligned"].items():
        assert (module, value) in flagged


def test_tiny_grads_is_statically_clean(planted):
    m = planted("tiny_grads")
    report = ampaudit.check(m.build_model(), *m.example_inputs())
    assert report.at_or_above("warning") == []


def test_einsum_and_addmm_dims():
    fire = Fn(lambda s, x: torch.einsum("bik,bkj->bij", x, x.transpose(-1, -2)))
    found = [f for f in ampaudit.check(fire, torch.randn(2, 16, 30), device="cuda").findings if f.rule == "AMP104"]
    assert [f.details["value"] for f in found] == [30]
    clean = Fn(lambda s, x: torch.einsum("bik,bkj->bij", x, x.transpose(-1, -2)))
    assert not [f for f in ampaudit.check(clean, torch.randn(2, 16, 32), device="cuda").findings if f.rule == "AMP104"]
    addmm = Fn(lambda s, x: torch.addmm(x[:, :1], x, x.t()))
    assert hits(addmm, torch.randn(12, 16), device="cuda", rule="AMP104")


def test_autocast_disabled_region_computes_in_input_dtype():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 30)

        def forward(self, x):
            h = self.fc(x)
            with torch.autocast("cpu", enabled=False):
                z = self.fc(x.float())   # runs in fp32: no alignment finding, and its sum is fp32
            return h.softmax(-1) + z.sum()

    found = {(f.rule, f.op) for f in ampaudit.check(M(), X16, device="cpu").findings}
    assert ("AMP201", "softmax") in found and ("AMP203", "sum") not in found


def test_gemm_rows_reported_once_per_distinct_value():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    found = hits(model, torch.randn(100, 16), device="cuda", rule="AMP106")
    assert found == [("AMP106", "info", "0")]
    assert hits(model, torch.randn(96, 16), device="cuda", rule="AMP106") == []


class OnlyUnderAutocast(nn.Module):
    """Mixes dtypes itself (a half activation meets an fp32 parameter in dot): runs only where autocast promotes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.dot(self.lin(x).half()[0], self.w)


def test_a_model_that_runs_only_under_autocast_is_audited():
    """CUDA autocast promotes dot's inputs, so the model runs there and is audited, not refused as unfit inputs;
    CPU autocast does not, so there the line is an error."""
    assert hits(OnlyUnderAutocast(), X16, device="cuda", rule="AMP207") == []
    assert hits(OnlyUnderAutocast(), X16, device="cpu", dtype="bfloat16", rule="AMP207") == [("AMP207", "error", "")]


def test_calibrated_raise_on_mixed_dtypes_names_the_cast_as_fix():
    model = Proj(lambda h: torch.zeros(4, 16).index_add_(0, torch.arange(4), h))
    report = ampaudit.check(model, X16, device="cpu", dtype="bfloat16", calibrate=True)
    raised = [f for f in report.findings if f.rule == "AMP602"]
    assert raised and "cast the operands to one dtype" in raised[0].fix, report.to_dict()["findings"]


class EinsumAfterBias(nn.Module):
    """maxvit's attention: scores + an fp32 bias are fp32, v is bf16, and einsum takes both (its bmm is lowered)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.bias = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = (torch.einsum("bid,bjd->bij", q, k) + self.bias).softmax(-1)
        return torch.einsum("bij,bjd->bid", attn, v)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_composite_op_that_autocast_casts_inside_is_not_a_raise(device):
    with torch.device(device):
        model = EinsumAfterBias()
    assert hits(model, torch.randn(2, 4, 16), device="cpu", dtype="bfloat16", rule="AMP207") == []
