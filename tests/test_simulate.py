"""The CUDA simulation (ampaudit.simulate) against CUDA autocast: PyTorch's own CUDA test lists, every way of
reaching an op (compared with CUDA autocast run on fake CUDA tensors), and the static audit's dtypes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampaudit.policy import Policy
from ampaudit.simulate import overrides, simulation

from _autocast_lists import autocast_lists, split

LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}

# CUDA list -> (where the list's test looks the op up besides Tensor, output dtype: "low", a dtype, or "entry"
# for the dtype the entry names), as in test/test_cuda.py's test_autocast_*.
CUDA_LISTS = {
    "torch_fp16": (torch, "low"), "torch_fp32": (torch, torch.float32),
    "torch_need_autocast_promote": (torch, torch.float32), "torch_expect_builtin_promote": (torch, "entry"),
    "nn_fp16": (torch._C._nn, "low"), "nn_fp32": (torch._C._nn, torch.float32),
    "linalg_fp16": (torch._C._linalg, "low"), "methods_fp16": (None, "low"), "methods_fp32": (None, torch.float32),
    "methods_expect_builtin_promote": (None, "entry"),
}
# Entries the simulation cannot run on CPU tensors, and why.
SKIP = {
    "cudnn_convolution": "CUDA-only op: no CPU kernel",
    "cudnn_convolution_transpose": "CUDA-only op: no CPU kernel",
    "einsum": "the entry pairs a 4-D equation with 2-D operands (test_cuda.py skips it: its third item reads as "
              "the ROCm skip flag)",
}


def _entries():
    cuda, _ = autocast_lists()
    for name in CUDA_LISTS:
        for i, entry in enumerate(getattr(cuda, name)):
            yield pytest.param(name, entry, id=f"{name}-{i}-{entry[0]}")


def _run(op: str, args: tuple, kwargs: dict, module, low: torch.dtype) -> list:
    outs = []
    with torch.autocast("cpu", dtype=low), simulation(Policy.load("cuda", str(low).replace("torch.", ""))):
        if module is not None and hasattr(module, op):
            outs.append(getattr(module, op)(*args, **kwargs))
        if hasattr(torch.Tensor, op):
            outs.append(getattr(args[0], op)(*args[1:], **kwargs))
    assert outs, f"{op} is neither on {module} nor a Tensor method"
    return outs


@pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,entry", list(_entries()))
def test_simulation_matches_pytorch_cuda_autocast_lists(name, entry, dtype):
    op, args, kwargs = split(entry)
    if op in SKIP:
        pytest.skip(SKIP[op])
    if name == "torch_fp16" and len(entry) > 2 and not isinstance(entry[2], dict):
        args, kwargs = entry[1], {}     # ("cudnn_convolution", args, TEST_WITH_ROCM)
    module, want = CUDA_LISTS[name]
    run_as = LOW[dtype] if want == "low" else want
    want = entry[-1] if want == "entry" else run_as
    outs = _run(op, args, kwargs, module, LOW[dtype])
    for out in outs:
        got = out.dtype if isinstance(out, torch.Tensor) else \
            next((o.dtype for o in out if isinstance(o, torch.Tensor)), None) if isinstance(out, tuple) else None
        if got is not None:          # `equal` returns a bool
            assert got == want, f"{op}: CUDA autocast gives {want}, the simulation {got}"
    if run_as != "entry":
        # As test_cuda.py checks CUDA autocast: bitwise the op run without autocast on inputs cast by hand, with
        # the simulation's kernels (kernels.toml's simulated_in_fp32 ops compute in fp32 as CUDA's do).
        with simulation(Policy.load("cuda", dtype)):
            if module is not None and hasattr(module, op):
                control = getattr(module, op)(*_cast(args, run_as), **kwargs)
            else:
                control = getattr(args[0].to(run_as), op)(*_cast(args[1:], run_as), **kwargs)
        assert _equal(outs[0], control), f"{op}: the simulation's numbers differ from the op run in {run_as}"


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_banned_op_raises_as_on_cuda():
    cuda, _ = autocast_lists()
    for op, args, module in cuda.banned:
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            _run(op, args, {}, module, torch.float16)


def test_simulation_leaves_cpu_autocast_as_it_was():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        before = (F.softmax(x.half(), -1).dtype, F.max_pool3d(torch.randn(1, 1, 4, 4, 4).half(), 2).dtype)
        with simulation(Policy.load("cuda", "float16")):
            during = (F.softmax(x.half(), -1).dtype, F.max_pool3d(torch.randn(1, 1, 4, 4, 4).half(), 2).dtype)
        after = (F.softmax(x.half(), -1).dtype, F.max_pool3d(torch.randn(1, 1, 4, 4, 4).half(), 2).dtype)
    assert before == after == (torch.float16, torch.float32)
    assert during == (torch.float32, torch.float16)   # CUDA: softmax fp32, max_pool3d as its input


def test_nested_and_raising_simulations_put_cpu_autocast_back():
    policy = Policy.load("cuda", "float16")
    x = torch.randn(4, 8).half()
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(ValueError):
            with simulation(policy):
                with simulation(policy):
                    assert F.softmax(x, -1).dtype == torch.float32
                assert F.softmax(x, -1).dtype == torch.float32
                raise ValueError("the forward raised")
        assert F.softmax(x, -1).dtype == torch.float16


def test_overrides_are_where_the_policies_differ():
    """(The tables name every op autocast registers: test_policy_tables.)"""
    got = overrides("cuda", "float16")
    assert got["aten::norm.ScalarOpt_dim"] == "fp32_output" and got["aten::exp"] == "fp32"
    assert got["aten::max_pool3d"] is None and got["aten::cat"] is None      # CPU casts them, CUDA does not
    assert got["aten::mv"] == "lower" and got["aten::binary_cross_entropy"] == "banned"
    assert "aten::conv2d" not in got and "aten::mse_loss" not in got         # the same on both


# -- every way of reaching an op, against CUDA autocast itself (fake CUDA tensors) ------------------------------

REACH = {
    "torch.norm": lambda x: torch.norm(x, dim=-1), "Tensor.norm": lambda x: x.norm(dim=-1),
    "F.normalize": lambda x: F.normalize(x, dim=-1), "linalg.vector_norm": lambda x: torch.linalg.vector_norm(x, dim=-1),
    "torch.softmax": lambda x: torch.softmax(x, -1), "Tensor.softmax": lambda x: x.softmax(-1),
    "F.softmax": lambda x: F.softmax(x, -1), "nn.Softmax": lambda x: nn.Softmax(-1)(x),
    "F.log_softmax": lambda x: F.log_softmax(x, -1), "F.softmax(dtype)": lambda x: F.softmax(x, -1, dtype=x.dtype),
    "torch.exp": torch.exp, "Tensor.exp": lambda x: x.exp(), "Tensor.exp_": lambda x: x.clone().exp_(),
    "torch.exp(out=)": lambda x: torch.exp(x, out=torch.empty_like(x)), "x ** 2": lambda x: x ** 2,
    "Tensor.pow_": lambda x: x.clone().pow_(2), "Tensor.sum": lambda x: x.sum(-1), "torch.sum": torch.sum,
    "Tensor.mean": lambda x: x.mean(-1), "cumsum": lambda x: x.cumsum(-1),
    "F.layer_norm": lambda x: F.layer_norm(x, (8,)), "nn.LayerNorm": lambda x: nn.LayerNorm(8, device=x.device)(x),
    "F.rms_norm": lambda x: F.rms_norm(x, (8,)), "F.group_norm": lambda x: F.group_norm(x, 2),
    "F.cosine_similarity": lambda x: F.cosine_similarity(x, x), "F.pairwise_distance": lambda x: F.pairwise_distance(x, x),
    "F.mse_loss": lambda x: F.mse_loss(x, x), "F.cross_entropy": lambda x: F.cross_entropy(x, x.softmax(-1)),
    "F.interpolate": lambda x: F.interpolate(x[None], scale_factor=2), "torch.mv": lambda x: torch.mv(x, x[0]),
    "F.linear": lambda x: F.linear(x, x), "nn.Linear": lambda x: nn.Linear(8, 8, device=x.device)(x),
    "x @ x": lambda x: x @ x, "einsum": lambda x: torch.einsum("ij,jk->ik", x, x),
    "F.conv1d(same)": lambda x: F.conv1d(x[None], x[:, :, None], padding="same"),
    "torch.dot(mixed)": lambda x: torch.dot(x[0], x[0].float()), "torch.cat(mixed)": lambda x: torch.cat([x, x.float()]),
    "addcmul": lambda x: torch.addcmul(x.float(), x, x), "F.gelu": F.gelu, "F.silu": F.silu,
}


# Ways fake CUDA tensors cannot run on a CPU-only build ("not linked with support for cuda devices"): the dtype
# CUDA autocast gives them (aten/src/ATen/autocast_mode.cpp: mv, conv, linear lower; upsample fp32; dot promotes).
NO_FAKE_KERNEL = {"F.conv1d(same)": "low", "torch.mv": "low", "nn.Linear": "low", "F.interpolate": torch.float32,
                  "torch.dot(mixed)": torch.float32}


def _fake_cuda(fn, dtype: torch.dtype, low: torch.dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", low)
        try:
            return fn(torch.rand(8, 8, device="cuda", dtype=dtype) + 0.5).dtype
        finally:
            torch.set_autocast_enabled("cuda", False)


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("way", sorted(REACH))
def test_every_way_of_reaching_an_op_follows_cuda_autocast(way, input_dtype, low):
    fn = REACH[way]
    if way in NO_FAKE_KERNEL:
        want = LOW[low] if NO_FAKE_KERNEL[way] == "low" else NO_FAKE_KERNEL[way]
    else:
        want = _fake_cuda(fn, input_dtype, LOW[low])
    with torch.autocast("cpu", dtype=LOW[low]), simulation(Policy.load("cuda", low)), torch.no_grad():
        got = fn(torch.rand(8, 8, dtype=input_dtype) + 0.5).dtype
    assert got == want, f"{way}: CUDA autocast gives {want}, the simulation {got}"


# -- ops CPU has no low-precision kernel for ---------------------------------------------------------------------

@torch.library.custom_op("ampaudit_test::no_half_kernel", mutates_args=())
def _no_half_kernel(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float16:
        raise NotImplementedError('"no_half_kernel" not implemented for \'Half\'')
    return x * 2


def test_op_without_a_cpu_half_kernel_runs_in_fp32_and_is_noted():
    from ampaudit.notes import collect

    x = torch.full((4,), 3.0, dtype=torch.float16)
    with collect() as notes, torch.autocast("cpu", dtype=torch.float16), \
            simulation(Policy.load("cuda", "float16")) as sim:
        out = _no_half_kernel(x)
    assert out.dtype == torch.float16 and out.tolist() == [6.0] * 4     # as a CUDA half kernel would give
    assert len(sim.notes) == 1 and "no_half_kernel" in sim.notes[0] and "Half" in sim.notes[0]
    assert notes == sim.notes
    with pytest.raises(NotImplementedError):       # a CPU target: the missing kernel is real
        _no_half_kernel(x)


def test_in_place_op_without_a_cpu_half_kernel_writes_into_its_input():
    @torch.library.custom_op("ampaudit_test::no_half_inplace", mutates_args=("x",))
    def no_half_inplace(x: torch.Tensor) -> None:
        if x.dtype == torch.float16:
            raise NotImplementedError('"no_half_inplace" not implemented for \'Half\'')
        x.mul_(2)

    x = torch.full((3,), 1.5, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), simulation(Policy.load("cuda", "float16")):
        no_half_inplace(x)
    assert x.dtype == torch.float16 and x.tolist() == [3.0] * 3


# -- planted models: one per way of reaching a precision-sensitive op ------------------------------------------

class _Reach(nn.Module):
    """A bias-free projection (a GEMM: fp16 under either autocast) and then ``how`` of its output."""

    def __init__(self, how):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(8))
        self.how = how
        self.softmax = nn.Softmax(-1)

    def forward(self, x):
        return self.how(self, self.proj(x))


# A zero row: its norm is 0, and the 1e-12 floor is 0 in fp16, so the row becomes 0/0 unless the norm runs in fp32
# (CUDA autocast: norm and linalg_vector_norm are fp32_output). The module way: a softmax of logits 40 apart is
# ~4e-18 at the small end, 0 in fp16 and then log(0) = -inf, unless the softmax runs in fp32 (CUDA: fp32_output).
PLANTED_REACH = {
    "function": lambda m, y: y / torch.norm(y, dim=-1, keepdim=True).clamp_min(1e-12),
    "method": lambda m, y: y / y.norm(dim=-1, keepdim=True).clamp_min(1e-12),
    "helper": lambda m, y: F.normalize(y, dim=-1),
    "module": lambda m, y: torch.log(m.softmax(y)),
}


def _planted_input(way: str) -> torch.Tensor:
    x = torch.rand(4, 8) + 0.5
    if way == "module":
        x[0, 0] = 40.0
    else:
        x[0] = 0.0
    return x


@pytest.mark.parametrize("way", sorted(PLANTED_REACH))
def test_planted_reach_is_clean_under_cuda_and_nonfinite_under_cpu_fp16(way):
    import ampaudit

    torch.manual_seed(0)
    model, x = _Reach(PLANTED_REACH[way]).eval(), _planted_input(way)
    cuda = ampaudit.check(model, x, device="cuda", dtype="float16", calibrate=True)
    cpu = ampaudit.check(model, x, device="cpu", dtype="float16", calibrate=True)
    # Forward only: the backward of y / 1e-12 is a gradient of 1e12 cast to y's fp16, inf on a real GPU too.
    forward = lambda report: [f for f in report.findings if f.rule == "AMP601" and f.details["phase"] == "forward"]  # noqa: E731
    assert not forward(cuda), [f.message for f in forward(cuda)]
    assert forward(cpu), [f.message for f in cpu.findings]


# -- the static audit's dtypes against the simulation's, node for node ------------------------------------------

class _Recorder(torch.fx.Interpreter):
    """Runs a graph for real and records each node's output dtype."""

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


def _model_files():
    from conftest import PLANTED, ROOT, SAMPLES

    folders = [PLANTED, ROOT / "tests" / "planted", SAMPLES]
    return sorted((p for folder in folders if folder.is_dir() for p in folder.glob("*.py") if not p.name.startswith("_")),
                  key=lambda p: (p.parent.name, p.name))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path", _model_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_static_audit_dtypes_match_the_simulation(path, dtype):
    """Every node's dtype in ``audit(..., device="cuda")`` (node.meta["amp"]) is what the CUDA simulation gives it
    when the captured graph runs, leaf modules' outputs included."""
    from ampaudit.analysis import AMP_KEY
    from ampaudit.api import audit

    from conftest import load_module

    m = load_module(path)
    model = m.build_model().eval()
    args = m.example_inputs()
    args = args if isinstance(args, tuple) else (args,)
    result = audit(model, *args, device="cuda", dtype=dtype)
    gm = result.capture.gm
    rec = _Recorder(gm)
    rec.dtypes = {}
    try:
        with torch.autocast("cpu", dtype=LOW[dtype]), simulation(result.policy), torch.no_grad():
            rec.run(*result.capture.graph_inputs(args, {})[0])
    except RuntimeError as exc:  # mask_fill_crash raises under fp16 autocast, as on CUDA: compare what ran
        # (A kernel this CPU lacks in fp16, oneDNN's LSTM, runs in fp32 under the simulation: it does not raise.)
        predicted = any(f.rule == "AMP207" for f in result.report.findings)   # the audit said this op raises
        assert predicted or ("overflow" in str(exc) and dtype == "float16"), exc
    compared = [n for n in gm.graph.nodes if n.name in rec.dtypes and AMP_KEY in n.meta]
    wrong = {n.name: (n.format_node(), str(n.meta[AMP_KEY].dtype), str(rec.dtypes[n.name])) for n in compared
             if n.meta[AMP_KEY].dtype != rec.dtypes[n.name]}
    assert compared and not wrong, wrong
    # Leaf modules' outputs are compared where the capture keeps them as modules (fx; an export has no call_module:
    # gated_recurrence_bf16's scan over range(T) defeats fx).
    assert any(n.op == "call_module" for n in compared) or path.name == "misaligned_mlp.py" \
        or result.capture.mode != "fx"


# -- the static audit's dtype for each way of reaching an op, against the simulation's ---------------------------

HELPERS = {
    "F.pairwise_distance": lambda x: F.pairwise_distance(x, x), "F.softmin": lambda x: F.softmin(x, -1),
    "F.gumbel_softmax": lambda x: F.gumbel_softmax(x), "F.local_response_norm": lambda x: F.local_response_norm(x[None], 2),
    "F.lp_pool2d": lambda x: F.lp_pool2d(x[None], 2, 2), "F.gaussian_nll_loss": lambda x: F.gaussian_nll_loss(x, x, x.abs()),
    "F.triplet_margin_with_distance_loss": lambda x: F.triplet_margin_with_distance_loss(x, x, x),
    "F.logsigmoid": F.logsigmoid, "F.mish": F.mish, "F.glu": F.glu, "F.avg_pool2d": lambda x: F.avg_pool2d(x[None], 2),
    "F.batch_norm": lambda x: F.batch_norm(x, torch.zeros(8), torch.ones(8)), "Tensor.var": lambda x: x.var(-1),
    "torch.atan2": lambda x: torch.atan2(x, x), "torch.cdist": lambda x: torch.cdist(x, x), "Tensor.renorm": lambda x: x.renorm(2, 0, 1.0),
    "torch.linalg.norm": lambda x: torch.linalg.norm(x, dim=-1), "torch.norm(fro)": lambda x: torch.norm(x, p="fro"),
    "Tensor.logsumexp": lambda x: x.logsumexp(-1), "torch.addmv": lambda x: torch.addmv(x[0], x, x[0]),
}
# Module forms: (factory, how the module is called on the fp16 output of a Linear)
MODULES = {
    "nn.Softmax": (lambda: nn.Softmax(-1), 1), "nn.LogSoftmax": (lambda: nn.LogSoftmax(-1), 1),
    "nn.Softmin": (lambda: nn.Softmin(-1), 1), "nn.LayerNorm": (lambda: nn.LayerNorm(8), 1),
    "nn.RMSNorm": (lambda: nn.RMSNorm(8), 1), "nn.GroupNorm": (lambda: nn.GroupNorm(2, 8), 1),
    "nn.LocalResponseNorm": (lambda: nn.LocalResponseNorm(2), 3), "nn.CosineSimilarity": (lambda: nn.CosineSimilarity(), 2),
    "nn.Upsample": (lambda: nn.Upsample(scale_factor=2), 3), "nn.Softplus": (lambda: nn.Softplus(), 1),
    "nn.MSELoss": (lambda: nn.MSELoss(), 2), "nn.KLDivLoss": (lambda: nn.KLDivLoss(reduction="batchmean"), 2),
    "nn.BCEWithLogitsLoss": (lambda: nn.BCEWithLogitsLoss(), 2), "nn.Linear": (lambda: nn.Linear(8, 8), 1),
    "nn.GELU": (lambda: nn.GELU(), 1), "nn.BatchNorm1d": (lambda: nn.BatchNorm1d(8), 1),
}


class _Way(nn.Module):
    def __init__(self, fn=None, module=None, how=1):
        super().__init__()
        self.pre = nn.Linear(8, 8)          # a GEMM first: its output is fp16 under either autocast
        self.fn, self.m, self.how = fn, module, how

    def forward(self, x):
        y = self.pre(x)
        if self.m is None:
            return self.fn(y)
        return self.m(y) if self.how == 1 else self.m(y, y) if self.how == 2 else self.m(y[None])


# Where the static audit is known to differ (amp_prop.py), and why.
STATIC_GAPS = {"torch.exp(out=)": "autocast leaves out= variants alone (the out tensor's dtype wins); AmpProp types "
                                  "the call by exp's category"}


def _ways():
    for name, fn in sorted({**{k: v for k, v in REACH.items() if not k.startswith("nn.")}, **HELPERS}.items()):
        marks = [pytest.mark.xfail(reason=STATIC_GAPS[name], strict=True)] if name in STATIC_GAPS else []
        yield pytest.param(lambda fn=fn: _Way(fn), id=name, marks=marks)
    for name, (factory, how) in sorted(MODULES.items()):
        yield pytest.param(lambda factory=factory, how=how: _Way(module=factory(), how=how), id=name)


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("build", list(_ways()))
def test_static_audit_agrees_with_the_simulation_for_every_way(build, low):
    """The output dtype the static audit gives each helper, method and module (fx records them whole) is the one
    the simulation (CUDA autocast) gives it."""
    from ampaudit.analysis import AMP_KEY
    from ampaudit.api import audit

    torch.manual_seed(0)
    model, x = build().eval(), torch.rand(8, 8) + 0.5
    with torch.autocast("cpu", dtype=LOW[low]), simulation(Policy.load("cuda", low)), torch.no_grad():
        want = model(x).dtype
    out = next(n for n in audit(model, x, device="cuda", dtype=low).capture.gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    assert node.meta[AMP_KEY].dtype == want, f"{node.format_node()}: static {node.meta[AMP_KEY].dtype}, CUDA {want}"
