"""Dispatch-level capture: record every aten op one forward runs, even through data-dependent control flow.

    cap = capture_dispatch(model, args, kwargs)   # Capture(gm, mode="dispatch")

A ``TorchDispatchMode`` sees each aten op with its tensors; module forward hooks keep a stack of the modules whose
forward is running, so each op is attributed to the innermost one (the module whose own code ran it), and the
Python stack gives its line (the user's, else the model library's: ``ampaudit.capture.source_lines``). The ops
are written into a straight-line fx graph (parameters as get_attr nodes under their own names), so propagation
and rules run on it exactly as on an fx or export capture. The forward runs for real once in fp32 (on the meta
device for a meta model); the graph is the path those inputs took, so it cannot be rewritten by ``fix``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from ampaudit.capture.fx_capture import Capture, model_code_only, origin_of_running
from ampaudit.capture.graph_module_paths import GraphModulePaths
from ampaudit.graph_meta import EXAMPLE_KEY, MODULE_KEY, SOURCE_KEY, set_origin
from ampaudit.errors import CaptureError
from ampaudit.policy import Policy
from ampaudit.simulate import observing, target_autocast



class _Shape:
    """A recorded output's shape and dtype, kept until the forward is over (see :meth:`_Recorder.examples`)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype


def _meta_of(shape: _Shape) -> torch.Tensor:
    return torch.empty(shape.shape, dtype=shape.dtype, device="meta")


# What an aten op's arguments and results hold besides tensors and plain lists, tuples and dicts of them.
_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _map_tensors(fn, value, leaf: type = torch.Tensor):
    """``tree_map(lambda v: fn(v) if isinstance(v, leaf) else v, value)`` without pytree's per-leaf machinery
    (tens of microseconds a call, twice per op of the forward) for what aten ops take and return; any other
    container goes to tree_map."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([_map_tensors(fn, v, leaf) for v in value])
    if isinstance(value, leaf):
        return fn(value)
    if kind in _LEAVES:
        return value
    if kind is dict:
        return {k: _map_tensors(fn, v, leaf) for k, v in value.items()}
    return tree_map(lambda v: fn(v) if isinstance(v, leaf) else v, value)


def _graph_module(root: dict, graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule whose Python code is generated only if something calls it or reads ``.code``: propagation
    and the rules only walk the graph, and generating and compiling a detection model's 3000-line forward is a
    tenth of a second (torch's own lazy GraphModule; a plain one where this torch has none)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:         # pragma: no cover - torch without the lazy variant
        return fx.GraphModule(root, graph, name)
    return _LazyGraphModule(root, graph, name)


# Ops that only describe tensors, not compute with them: kept out of the graph.
_SKIP = {"detach", "alias", "lift_fresh", "_has_compatible_shallow_copy_type", "is_same_size"}


class _ModuleStack:
    """Global forward hooks that keep the dotted names of the modules whose forward is running."""

    def __init__(self, root: nn.Module):
        self.names = {id(m): n for n, m in root.named_modules()}
        self.paths = GraphModulePaths(root)     # the modules a user's GraphModule's flat code belongs to
        self.stack: list[str] = []
        self._handles = []

    def __enter__(self):
        from torch.nn.modules import module as mod

        self._handles = [mod.register_module_forward_pre_hook(self._pre), mod.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _pre(self, module, args):
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _post(self, module, args, output):
        if id(module) in self.names and self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: fx.Graph, modules: _ModuleStack, known: WeakIdKeyDictionary, consts: dict):
        super().__init__()
        self.graph, self.modules, self.known, self.consts = graph, modules, known, consts
        self.paused = False    # inside an op the simulation runs: its casts and pieces are not the model's
        self.pending: list[tuple[fx.Node, object]] = []   # (node, its output as _Shape leaves)

    def _node_for(self, t: torch.Tensor) -> fx.Node:
        node = self.known.get(t)
        if node is None:  # a tensor made outside the graph (a constant, a cached buffer): keep it as an attribute
            name = f"_const_{len(self.consts)}"
            self.consts[name] = t.detach()
            node = self.graph.get_attr(name)
            self.known[t] = node
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        if func.overloadpacket.__name__ in _SKIP:
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and args[0] in self.known:
                self.known[out] = self.known[args[0]]
            return out
        return self._add(func, args, kwargs, out)

    def simulated(self, func, args, kwargs, run):
        """An op the CUDA simulation casts (:func:`ampaudit.simulate.observing`): one node, the model's own call
        with its own arguments, as for the ops autocast leaves alone; the policy types it statically."""
        if self.paused:
            return run()
        self.paused = True
        try:
            out = run()
        finally:
            self.paused = False
        return self._add(func, args, kwargs, out)

    def _add(self, func, args, kwargs, out):
        node = self.graph.call_function(func, _map_tensors(self._node_for, tuple(args)),
                                        _map_tensors(self._node_for, dict(kwargs)))
        set_origin(node, *origin_of_running(self.modules.current, self.modules.paths))
        self.pending.append((node, _map_tensors(_Shape, out)))
        if isinstance(out, torch.Tensor):
            self.known[out] = node
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    item = self.graph.call_function(_getitem, (node, i))
                    item.meta.update({MODULE_KEY: node.meta[MODULE_KEY], SOURCE_KEY: node.meta[SOURCE_KEY]})
                    self.pending.append((item, _Shape(o)))
                    self.known[o] = item
        return out

    def examples(self) -> None:
        """What each op really returned, as meta tensors, on its node (EXAMPLE_KEY): propagation falls back on it
        where an op has no fake kernel (nonzero, data-dependent indexing), so shapes downstream stay known for
        this recorded path. Made once the forward is over: inside it every torch.empty would pass through the
        CUDA simulation's dispatch mode, at many times the cost."""
        for node, shapes in self.pending:
            node.meta[EXAMPLE_KEY] = _map_tensors(_meta_of, shapes, _Shape)
        self.pending.clear()


class WholeLinear(TorchFunctionMode):
    """``F.linear`` recorded as the one ``aten.linear`` call the model made, where no autocast runs it (a forward
    recorded in fp32; a wrapped body recorded on fake tensors). On a strided input aten splits linear into ``mm``
    and an add of the float32 bias, which the policy would type float32, where autocast lowers the whole linear.
    """

    def __init__(self, recorder: "_Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not self.recorder.paused:
            return self.recorder.simulated(torch.ops.aten.linear.default, args, kwargs, lambda: func(*args, **kwargs))
        return func(*args, **kwargs)


def _getitem(seq, i):
    return seq[i]


_getitem.__name__ = "getitem"


def _record(model, args, kwargs, graph, modules, known, consts, device_type, policy):
    recorder = _Recorder(graph, modules, known, consts)
    amp = WholeLinear(recorder) if policy is None else target_autocast(policy, device_type)
    # The target's autocast outside the recorder: the simulation's own dispatch mode must not be recorded.
    try:
        with torch.no_grad(), amp, observing(recorder.simulated), modules, recorder, model_code_only(model):
            return model(*args, **kwargs)
    finally:
        recorder.examples()


def capture_dispatch(model: nn.Module, args: tuple, kwargs: dict, *, policy: Policy | None = None,
                     _notes: list | None = None) -> Capture:
    """Run one forward under the recorder and return the straight-line graph of aten ops it ran.

    With ``policy`` the forward runs under the target's autocast (:func:`ampaudit.simulate.target_autocast`), so
    ``.to(x.dtype)`` records the dtype x really has under autocast (an fp32 run would bake in fp32); if that
    forward raises, fp32 is used.
    """
    graph = fx.Graph()
    known = WeakIdKeyDictionary()
    consts: dict[str, torch.Tensor] = {}
    attrs: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t not in known:
            known[t] = graph.get_attr(name)
            attrs[name] = t
    flat, spec = tree_flatten((tuple(args), dict(kwargs)))
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            known[a] = graph.placeholder(f"input_{i}")
    modules = _ModuleStack(model)
    device_type = next((t.device.type for t in attrs.values()), "cpu")
    notes = []
    try:
        out = _record(model, args, kwargs, graph, modules, known, consts, device_type, policy)
    except Exception as exc:
        if policy is None:
            reason = " ".join(str(exc).split())[:200]
            raise CaptureError(f"the forward of {type(model).__name__} raised {type(exc).__name__}: {reason}",
                               hint="check that example_inputs() fits the model; run it in plain PyTorch first") from exc
        # The forward raises under autocast (a constant that does not fit, say): record the fp32 path instead.
        notes.append(f"the forward raised {type(exc).__name__} under {device_type} autocast; recorded in fp32")
        return capture_dispatch(model, args, kwargs, policy=None, _notes=notes)
    outs = [known.get(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    graph.output(tuple(o for o in outs if o is not None))
    graph.eliminate_dead_code()
    gm = _graph_module({**attrs, **consts}, graph, type(model).__name__)
    return Capture(gm=gm, mode="dispatch", root=model, notes=list(_notes or []))
