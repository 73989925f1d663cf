"""The capture fallbacks do no work twice: a data-dependent export is tried once, a repeated op is probed once."""
from __future__ import annotations

import torch
from torch import nn

import ampaudit
from ampaudit.analysis import mixed_dtypes
from ampaudit.capture import export_capture


class NmsLike(nn.Module):
    """Keeps the rows whose score passes a threshold, as detection's NMS does: the output size depends on values,
    so export cannot follow it, whatever the dtypes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        keep = h[:, 0] > 0
        if keep.sum() == 0:
            keep = torch.ones_like(keep)
        return self.head(h[keep]).softmax(-1)


class CrashesUnderAutocast(nn.Module):
    """Export fails only under autocast (a low-dtype source scattered into fp32), so the fp32 retry is needed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.dtype == torch.float32:
            return h * 2
        return torch.zeros(4, 8).scatter_add(0, torch.zeros(4, 8, dtype=torch.long), h)


def _count_exports(monkeypatch) -> list:
    calls = []
    real = export_capture._export_loud

    def counted(model, args, kwargs, policy):
        calls.append(None if policy is None else policy.low)
        return real(model, args, kwargs, policy)

    monkeypatch.setattr(export_capture, "_export_loud", counted)
    return calls


def test_data_dependent_export_is_not_retried_without_autocast(monkeypatch):
    calls = _count_exports(monkeypatch)
    report = ampaudit.check(NmsLike(), torch.randn(6, 8), device="cpu", dtype="bfloat16")
    assert report.capture == "dispatch"
    assert calls == [torch.bfloat16]          # one trace: the fp32 one would stop at the same guard
    assert any("export was not used" in n and "data-dependent" in n for n in report.notes)
    assert {f.module for f in report.findings if f.rule == "AMP201"}   # the softmax is still audited


def test_export_failing_only_under_autocast_is_retried_in_fp32(monkeypatch):
    calls = _count_exports(monkeypatch)
    report = ampaudit.check(CrashesUnderAutocast(), torch.randn(4, 8), device="cpu", dtype="bfloat16")
    assert calls == [torch.bfloat16, None]
    assert report.capture == "export"


def test_data_dependent_sees_through_wrapped_causes():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        try:
            raise GuardOnDataDependentSymNode("Could not guard on data-dependent expression", None)
        except RuntimeError as inner:
            raise ValueError("export failed") from inner
    except ValueError as outer:
        assert export_capture.data_dependent(outer)
    assert not export_capture.data_dependent(RuntimeError("mat1 and mat2 must have the same dtype"))


class RepeatedScatter(nn.Module):
    """The same mixed-dtype scatter_add (a low-dtype source into an fp32 buffer) in three blocks of one shape."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        out = []
        for block in self.blocks:
            h = block(x)
            out.append(torch.zeros(4, 16).scatter_add(0, torch.zeros(4, 16, dtype=torch.long), h))
        return torch.stack(out)


def test_repeated_op_is_probed_once_and_flagged_at_every_call(monkeypatch):
    probes = []
    real = mixed_dtypes._probe

    def counted(interp, n, args, kwargs, dtypes):
        probes.append(n.name)
        return real(interp, n, args, kwargs, dtypes)

    monkeypatch.setattr(mixed_dtypes, "_probe", counted)
    report = ampaudit.check(RepeatedScatter(), torch.randn(4, 16), device="cpu", dtype="bfloat16",
                            capture_mode="export")
    flagged = [f for f in report.findings if f.rule == "AMP207"]
    assert len(flagged) == 3 and len({f.node for f in flagged}) == 3
    assert len(probes) == 1


def test_probe_signature_tells_shapes_and_scalars_apart():
    import torch.fx as fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    a, b = torch.zeros(2, 3), torch.zeros(3, 2)
    assert mixed_dtypes._signature(node, (a, a), {}) == mixed_dtypes._signature(node, (a.clone(), a), {})
    assert mixed_dtypes._signature(node, (a, a), {}) != mixed_dtypes._signature(node, (b, b), {})
    assert mixed_dtypes._signature(node, (a, 1.0), {}) != mixed_dtypes._signature(node, (a, 2.0), {})
    assert mixed_dtypes._signature(node, (a, [a]), {}) != mixed_dtypes._signature(node, ([a], a), {})
    assert mixed_dtypes._signature(node, (a, object()), {}) is None   # a value it cannot compare: not memoised
    user = graph.call_function(lambda t: t, (x,))
    assert mixed_dtypes._signature(user, (a,), {}) is None        # the user's own function: never memoised


class MaskedSums(nn.Module):
    """Six boolean-mask selections: six data-dependent sizes, none guarded on, so torch.export follows them all
    (fx cannot: the loop runs over a shape)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.stack([h[h[:, i] > 0].sum(0) for i in range(h.shape[1] - 2)]).softmax(-1)


def test_export_that_keeps_making_data_dependent_sizes_gives_way_to_dispatch(monkeypatch):
    import ampaudit.capture as capture

    monkeypatch.setattr(capture, "export_unbacked_limit", lambda: 4)
    calls = _count_exports(monkeypatch)
    report = ampaudit.check(MaskedSums(), torch.randn(16, 8), device="cpu", dtype="bfloat16")
    assert report.capture == "dispatch"
    assert calls == [torch.bfloat16]           # not retried in fp32: the sizes do not depend on the dtypes
    assert any("export was not used" in n and "stopped after 4 data-dependent sizes" in n for n in report.notes)
    assert {f.module for f in report.findings if f.rule == "AMP201"}
    # Asked for by name, export has no fallback to give way to: it runs to the end.
    assert ampaudit.check(MaskedSums(), torch.randn(16, 8), device="cpu", dtype="bfloat16",
                          capture_mode="export").capture == "export"


def test_export_budget_leaves_the_shape_env_as_it_was():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    before = ShapeEnv.create_unbacked_symint
    try:
        with export_capture._unbacked_budget(0):
            ShapeEnv().create_unbacked_symint()
    except export_capture.TooDataDependent as exc:
        assert export_capture.data_dependent(exc)
    else:
        raise AssertionError("a budget of 0 let an unbacked size through")
    assert ShapeEnv.create_unbacked_symint is before


class Cache:
    """An output type pytree does not know (as transformers' EncoderDecoderCache)."""

    def __init__(self, t):
        self.t = t


class ReturnsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).softmax(-1)
        return h, Cache(h)


def test_export_returning_an_unknown_type_is_not_retried_without_autocast(monkeypatch):
    calls = _count_exports(monkeypatch)
    report = ampaudit.check(ReturnsCache(), torch.randn(4, 8), device="cpu", dtype="bfloat16")
    assert report.capture == "dispatch"
    assert calls == [torch.bfloat16]          # the fp32 forward returns the same type: one trace, not two
    assert any("export was not used" in n and "not a known type" in n for n in report.notes)
    assert {f.module for f in report.findings if f.rule == "AMP201"}


def test_unflattenable_output_reads_torchs_own_error():
    try:
        torch.export.export(ReturnsCache(), (torch.randn(4, 8),), strict=False)
    except Exception as exc:     # noqa: BLE001 - the error torch raises is the point
        assert export_capture.unflattenable_output(exc) and export_capture.fails_in_any_dtype(exc)
    else:
        raise AssertionError("torch.export flattened an unregistered class")
    assert not export_capture.unflattenable_output(RuntimeError("mat1 and mat2 must have the same dtype"))
    assert not export_capture.fails_in_any_dtype(TypeError("'NoneType' object is not subscriptable"))


class TopHalf(nn.Module):
    """A tuple-returning op (topk) between two layers: its items are getitem nodes, each with its own example."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        values, indices = self.fc(x).topk(4, dim=-1)
        return values.softmax(-1), indices


def test_dispatch_examples_are_meta_tensors_of_each_recorded_output():
    from ampaudit.capture import capture_dispatch
    from ampaudit.graph_meta import example_of
    from ampaudit.policy import Policy

    model, x = TopHalf(), torch.randn(3, 8)
    cap = capture_dispatch(model, (x,), {}, policy=Policy.load("cpu", "bfloat16"))
    ops = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    topk = next(n for n in ops if getattr(n.target, "_opname", "") == "topk")
    values, indices = (example_of(n) for n in ops if n.args and n.args[0] is topk)
    assert all(isinstance(t, torch.Tensor) and t.is_meta for t in example_of(topk))
    assert (values.shape, values.dtype) == ((3, 4), torch.bfloat16)      # the dtype autocast gave it
    assert (indices.shape, indices.dtype) == ((3, 4), torch.long)
    softmax = next(n for n in ops if getattr(n.target, "_opname", "") == "_softmax")
    assert example_of(softmax).shape == (3, 4) and example_of(softmax).is_meta


def test_dispatch_graph_module_generates_its_code_only_when_called():
    from ampaudit.capture import capture_dispatch

    model, x = TopHalf(), torch.randn(3, 8)
    gm = capture_dispatch(model, (x,), {}).gm
    assert "_code" not in gm.__dict__                                  # nothing generated while capturing
    values, indices = gm(x)                                            # calling it generates and runs it
    expected = model(x)
    assert torch.allclose(values, expected[0]) and torch.equal(indices, expected[1])
    assert "topk" in gm.code


def test_map_tensors_agrees_with_tree_map():
    from collections import namedtuple

    from torch.utils._pytree import tree_map

    from ampaudit.capture import dispatch_capture

    Pair = namedtuple("Pair", "a b")
    a, b = torch.zeros(2), torch.ones(3, dtype=torch.long)
    values = [a, (a, [b, None, 2.5]), {"x": a, "y": [1, True]}, torch.Size([2, 3]), Pair(a, 3),
              [torch.float16, torch.device("cpu"), "s", torch.strided, torch.channels_last], ()]

    def fn(t):
        return t.shape

    for v in values:
        expected = tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, v)
        got = dispatch_capture._map_tensors(fn, v)
        assert got == expected and type(got) is type(expected)
