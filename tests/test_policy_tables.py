"""The policy tables in rules/policy/ against autocast itself: CUDA simulated on fake tensors, CPU for real."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from ampaudit.analysis import AMP_KEY, AmpProp
from ampaudit.capture import capture
from ampaudit.policy import Policy

from conftest import PLANTED, SAMPLES, cpu_fp16_gap, load_module

# op name in the tables -> how to call it on a [4, 8, 8, 8] tensor
OPS = {
    "matmul": lambda x: x @ x, "bmm": lambda x: torch.bmm(x[0], x[0]), "linear": lambda x: F.linear(x, x[0, 0]),
    "conv2d": lambda x: F.conv2d(x, x), "softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, -1),
    "exp": torch.exp, "log": torch.log, "pow": lambda x: x.pow(2), "sum": lambda x: x.sum(-1), "cumsum": lambda x: x.cumsum(-1),
    "prod": lambda x: x.prod(-1), "layer_norm": lambda x: F.layer_norm(x, (8,)), "group_norm": lambda x: F.group_norm(x, 2),
    "mse_loss": lambda x: F.mse_loss(x, x), "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "relu": F.relu,
    "gelu": F.gelu, "tanh": torch.tanh, "mean": lambda x: x.mean(-1), "var": lambda x: x.var(-1),
    "softplus": F.softplus, "logsumexp": lambda x: x.logsumexp(-1), "l1_loss": lambda x: F.l1_loss(x, x),
    "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, x), "cosine_similarity": lambda x: F.cosine_similarity(x, x),
    "binary_cross_entropy_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, x.sigmoid()),
    "kl_div": lambda x: F.kl_div(x, x, reduction="batchmean"), "sigmoid": torch.sigmoid, "expm1": torch.expm1,
    "log1p": torch.log1p, "erfinv": torch.erfinv, "baddbmm": lambda x: torch.baddbmm(x[0], x[0], x[0]),
    "addmm": lambda x: torch.addmm(x[0, 0], x[0, 0], x[0, 0]), "mm": lambda x: torch.mm(x[0, 0], x[0, 0]),
    "norm": lambda x: torch.norm(x, dim=-1), "silu": F.silu, "cumprod": lambda x: x.cumprod(-1),
}


def expected(policy: Policy, op: str, input_dtype: torch.dtype) -> torch.dtype:
    cat = policy.category(op)
    if cat == "lower":
        return policy.low
    if cat in ("fp32", "fp32_output"):
        return torch.float32
    return input_dtype


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_cuda_table_matches_simulated_cuda_autocast(op, input_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = Policy.load("cuda", "float16")
    try:
        with FakeTensorMode(), torch.no_grad():
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", torch.float16)
            try:
                x = torch.rand(4, 8, 8, 8, device="cuda", dtype=input_dtype) + 0.5
                got = OPS[op](x).dtype
            finally:
                torch.set_autocast_enabled("cuda", False)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no fake CUDA kernel for {op}: {str(exc)[:80]}")
    assert got == expected(policy, op, input_dtype), f"{op}: table says {policy.category(op)}, autocast gave {got}"


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_table_matches_real_cpu_autocast(op, dtype):
    policy = Policy.load("cpu", dtype)
    x = (torch.rand(4, 8, 8, 8) + 0.5).to(policy.low)
    try:
        with torch.autocast("cpu", dtype=policy.low):
            got = OPS[op](x).dtype
    except RuntimeError as exc:
        pytest.skip(f"no CPU {dtype} kernel for {op}: {str(exc)[:80]}")
    assert got == expected(policy, op, policy.low), f"{op}: table says {policy.category(op)}, autocast gave {got}"


class _Recorder(fx.Interpreter):
    """Runs a graph for real and records each node's output dtype."""

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = out.dtype
        return out


def _models():
    out = []
    for folder in (PLANTED, SAMPLES):
        if folder.is_dir():
            out += sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    return out


@pytest.mark.parametrize("path", _models(), ids=lambda p: p.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_propagated_dtypes_match_real_cpu_autocast(path, dtype):
    """Every node's predicted autocast dtype equals what CPU autocast really produces."""
    m = load_module(path)
    gap = cpu_fp16_gap(m, grad=False) if dtype == "float16" else None
    if gap:
        pytest.skip(gap)     # this CPU cannot run the model under fp16 autocast: nothing real to compare with
    model = m.build_model().eval()
    args = m.example_inputs()
    args = args if isinstance(args, tuple) else (args,)
    policy = Policy.load("cpu", dtype)
    gm = capture(model).gm
    AmpProp(gm, policy).propagate(*args)
    rec = _Recorder(gm)
    rec.dtypes = {}
    try:
        with torch.autocast("cpu", dtype=policy.low), torch.no_grad():
            rec.run(*args)
    except RuntimeError as exc:  # e.g. mask_fill_crash raises under fp16 autocast: compare what ran
        assert "overflow" in str(exc) and dtype == "float16", exc
    wrong = {name: (str(n.meta[AMP_KEY].dtype), str(got)) for n in gm.graph.nodes
             for name, got in [(n.name, rec.dtypes.get(n.name))] if got is not None and AMP_KEY in n.meta
             and n.meta[AMP_KEY].dtype != got}
    assert not wrong, wrong


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", sorted(OPS))
def test_cuda_table_matches_real_cuda_autocast(op):
    policy = Policy.load("cuda", "float16")
    for input_dtype in (torch.float32, torch.float16):
        x = torch.rand(4, 8, 8, 8, device="cuda", dtype=input_dtype) + 0.5
        with torch.autocast("cuda", dtype=torch.float16):
            got = OPS[op](x).dtype
        assert got == expected(policy, op, input_dtype), f"{op} from {input_dtype}: autocast gave {got}"


# -- the tables against PyTorch's own autocast test lists and autocast's registrations ---------------------------

# list name -> the categories its ops must have in the device's table (None: unlisted, torch's promotion)
LIST_CATEGORIES = {
    "cuda": {"torch_fp16": ("lower",), "nn_fp16": ("lower",), "linalg_fp16": ("lower",), "methods_fp16": ("lower",),
             "torch_fp32": ("fp32", "fp32_output"), "nn_fp32": ("fp32", "fp32_output"),
             "methods_fp32": ("fp32", "fp32_output"), "torch_need_autocast_promote": ("promote",),
             "banned": ("banned",), "torch_expect_builtin_promote": (None,),
             "methods_expect_builtin_promote": (None,)},
    "cpu": {"torch_16": ("lower",), "nn_16": ("lower",), "torch_fp32": ("fp32",), "nn_fp32": ("fp32",),
            "torch_need_autocast_promote": ("promote",), "torch_expect_builtin_promote": (None,),
            "methods_expect_builtin_promote": (None,)},
}
# PyTorch registers some ops per overload; the tables name whole ops.
OVERLOAD_ONLY = {("cpu", "_convolution"): "CPU autocast lowers only _convolution.deprecated; the current overload "
                                          "runs in its inputs' dtype"}


def _table_category(policy: Policy, op: str) -> str | None:
    from ampaudit.policy import op_names

    return policy.category(op_names()["aliases"].get(op, op))


def _list_entries():
    from _autocast_lists import autocast_lists

    for device, lists in zip(("cuda", "cpu"), autocast_lists()):
        for name in LIST_CATEGORIES[device]:
            for entry in getattr(lists, name):
                yield pytest.param(device, name, entry[0], id=f"{device}-{name}-{entry[0]}")


@pytest.mark.parametrize("device,name,op", sorted(set(_list_entries()), key=lambda p: p.id))
def test_tables_agree_with_pytorch_autocast_test_lists(device, name, op):
    got = _table_category(Policy.load(device, "float16"), op)
    assert got in LIST_CATEGORIES[device][name], f"{device}.toml gives {op} {got}; PyTorch's {name} list says otherwise"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_tables_name_every_op_autocast_registers(device):
    """Each aten op torch registers on Autocast<device> is in that device's table (the CUDA simulation and the
    static audit read the category from there)."""
    from ampaudit.simulate import autocast_ops, packet

    policy = Policy.load(device, "float16")
    ops = {packet(q) for q in autocast_ops("Autocast" + device.upper())}
    missing = sorted(op for op in ops if _table_category(policy, op) is None and (device, op) not in OVERLOAD_ONLY)
    assert not missing, f"add to rules/policy/{device}.toml: {missing}"


@pytest.mark.parametrize("key", ["AutocastCPU", "AutocastCUDA"])
def test_the_ops_on_an_autocast_key_are_those_each_op_reports(key):
    """autocast_ops asks the dispatcher once for a key's registrations: the same ops as asking each op."""
    from ampaudit.simulate import autocast_ops

    each = {name for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}
    assert each and autocast_ops(key) == each


def _cpu_list_cases():
    from _autocast_lists import autocast_lists

    cpu = autocast_lists()[1]
    for name, want in (("torch_16", "low"), ("nn_16", "low"), ("torch_fp32", torch.float32),
                       ("nn_fp32", torch.float32), ("torch_need_autocast_promote", torch.float32),
                       ("torch_expect_builtin_promote", "entry"), ("methods_expect_builtin_promote", "entry")):
        for i, entry in enumerate(getattr(cpu, name)):
            yield pytest.param(name, entry, want, id=f"{name}-{i}-{entry[0]}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,entry,want", list(_cpu_list_cases()))
def test_real_cpu_autocast_gives_what_pytorch_cpu_lists_expect(name, entry, want, dtype):
    """The CPU lists' expectations hold on this torch (so the table checked against them describes it)."""
    low = getattr(torch, dtype)
    op = entry[0]
    if name in ("torch_need_autocast_promote", "torch_expect_builtin_promote", "methods_expect_builtin_promote"):
        args, kwargs = entry[1] if dtype == "bfloat16" else entry[2], {}     # (op, bf16 args, fp16 args[, out])
    else:
        args, kwargs = entry[1], (entry[2] if len(entry) > 2 else {})
    want = low if want == "low" else entry[-1] if want == "entry" else want
    module = torch._C._nn if name.startswith("nn_") else None if name.startswith("methods_") else torch
    outs = []
    with torch.autocast("cpu", dtype=low):
        if module is not None and hasattr(module, op):
            outs.append(getattr(module, op)(*args, **kwargs))
        if hasattr(torch.Tensor, op):
            outs.append(getattr(args[0], op)(*args[1:], **kwargs))
    assert outs
    for out in outs:
        t = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else None
        if t is not None:
            assert t.dtype == want, f"{op}: CPU autocast gave {t.dtype}, PyTorch's {name} expects {want}"
