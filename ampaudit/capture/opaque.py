"""Code torch.fx keeps opaque: functions registered with ``torch.fx.wrap`` (or a tracer's ``autowrap_functions``)
become one ``call_function`` node whose body no rule would see. This module opens them up.

    user_function(target)              # True for a Python function of the user's (not torch's, not ampaudit's)
    plain(value)                       # fx's immutable_list / immutable_dict -> list / dict, recursively
    inline_call(gm, node)              # re-trace node.target with fx and splice its ops in place of node
    record_call(gm, node, env)         # or record the aten ops it runs on env's values of its inputs
    unrecordable(node, env)            # why record_call could not (None: it could), splicing nothing
    with export_anchors(): torch.export.export(...)   # export keeps the lines inside fx-wrapped functions

Both return the first spliced node, :data:`NOTHING_INSIDE` when the function runs no tensor op (a shape
helper: the caller keeps the opaque node), or a one-line reason they could not. An fx re-trace holds for every
input; a recording is the path these inputs take (control flow on a shape, as in torchvision's Swin), so only
an audit splices it, never a graph that ``fix`` rewrites. The spliced nodes carry the calling node's module and
the function's own source lines (the caller's line where none was found).
"""
from __future__ import annotations

import contextlib
import operator
import types
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses import fake_tensor
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_flatten, tree_unflatten

from ampaudit.capture.fx_capture import AuditTracer, is_user_file
from ampaudit.graph_meta import MODULE_KEY, RECORDED_KEY, SOURCE_KEY, module_of, source_of

NOTHING_INSIDE = "no tensor op inside"
DEPTH_KEY = "ampaudit_inlined_depth"     # how many wrapped calls deep a spliced node sits
MAX_DEPTH = 8                            # a wrapped function calling itself stops here
# A body that fails on fake tensors at the real shapes reads tensor values (``if x.mean() > 0``): the dispatch
# capture runs the model on the example inputs' values and follows it.
VALUES_HINT = "it reads tensor values: --capture dispatch follows it on the example inputs"


def user_function(target: Any) -> bool:
    """A plain Python function defined in the user's code (torch.fx.wrap'd helpers, autowrapped functions)."""
    code = getattr(target, "__code__", None)
    return isinstance(target, types.FunctionType) and code is not None and is_user_file(code.co_filename)


def plain(value: Any) -> Any:
    """``value`` with fx's immutable containers (and every list, dict, tuple inside) as fresh plain ones, so
    user code that mutates an argument (``shift_size[i] = 0``) runs as it does eagerly."""
    if isinstance(value, (list, immutable_list)):
        return [plain(v) for v in value]
    if isinstance(value, (dict, immutable_dict)):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, slice):
        return slice(plain(value.start), plain(value.stop), plain(value.step))
    return value


def _caller(gm: fx.GraphModule, fn, spec, leaves: list, slots: list[int]) -> nn.Module:
    """A module whose forward takes one argument per slot, rebuilds ``fn``'s arguments and calls it (fx names
    placeholders after the parameters, so they are spelled out). It holds ``gm``'s own submodules, parameters and
    buffers (shared, not copied): a module the function is handed (``proj(x)``) traces as ``gm``'s
    ``call_module a.proj``, its weights as ``gm``'s attributes."""
    def build(*values):
        filled = list(leaves)
        for slot, v in zip(slots, values):
            filled[slot] = v
        args, kwargs = tree_unflatten(filled, spec)
        return fn(*args, **kwargs)

    params = ", ".join(f"a{i}" for i in range(len(slots)))
    ns = {"_build": build}
    exec(f"def forward(self, {params}):\n    return _build({params})\n", ns)
    holder = type(fn.__name__, (nn.Module,), {"forward": ns["forward"]})()
    for slot in ("_modules", "_parameters", "_buffers"):
        holder.__dict__[slot] = gm.__dict__[slot]
    return holder


def _modules_as_values(gm: fx.GraphModule, leaves: list) -> list:
    """``leaves`` with the graph's ``get_attr`` nodes of submodules replaced by the modules themselves."""
    out = []
    for v in leaves:
        if isinstance(v, fx.Node) and v.op == "get_attr":
            try:
                v = gm.get_submodule(str(v.target))
            except AttributeError:
                pass
        out.append(v)
    return out


def _computes(graph: fx.Graph) -> bool:
    return any(n.op in ("call_function", "call_method", "call_module") and n.target is not torch._assert
               for n in graph.nodes)


def _leaves(node: fx.Node):
    """The flat arguments of ``node`` (fx's containers made plain) and their spec, or a reason to leave it."""
    if node.meta.get(DEPTH_KEY, 0) >= MAX_DEPTH:
        return f"wrapped calls nest deeper than {MAX_DEPTH}"
    leaves, spec = tree_flatten(plain((tuple(node.args), dict(node.kwargs))))
    if any(isinstance(v, torch.nn.Module) for v in leaves):
        return "it takes a module as an argument"
    return leaves, spec


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"


def inline_call(gm: fx.GraphModule, node: fx.Node):
    """Splice the fx trace of ``node.target``'s body in place of ``node`` (see the module docstring)."""
    flat = _leaves(node)
    if isinstance(flat, str):
        return flat
    leaves, spec = flat
    handed = [v for v in leaves if isinstance(v, fx.Node) and v.op == "get_attr"]
    leaves = _modules_as_values(gm, leaves)
    slots = [i for i, v in enumerate(leaves) if isinstance(v, fx.Node)]
    tracer = AuditTracer()
    try:
        # Outside propagation's fake mode: a tensor the body builds from constants is real, as fix must keep it.
        with fake_tensor.unset_fake_temporarily():
            sub = tracer.trace(_caller(gm, node.target, spec, leaves, slots))
    except Exception as exc:
        return _reason(exc)
    if not _computes(sub):
        return NOTHING_INSIDE
    first = _splice(gm, node, sub, tracer.root, [leaves[i] for i in slots])
    for v in handed:              # a module's get_attr, now that its calls read the module itself
        if not v.users:
            gm.graph.erase_node(v)
    return first


def record_call(gm: fx.GraphModule, node: fx.Node, env: dict, policy=None, dtypes: dict | None = None):
    """Run ``node.target`` on ``env``'s values of its inputs (fake or meta tensors) under the dispatch recorder
    and splice the aten ops it ran in place of ``node``. With ``policy`` (an :class:`ampaudit.policy.Policy`) it
    runs under the target's autocast, as the dispatch capture runs a forward (``.float()`` on what autocast makes
    float16 is then a cast the recording sees), in fp32 where that raises; ``dtypes`` (node -> its dtype under
    autocast, as propagation tracks it) gives the inputs the dtypes they have there."""
    recorded = _record(node, env, policy, dtypes)
    if isinstance(recorded, str):
        return recorded
    return _splice(gm, node, *recorded, recorded=True)


def unrecordable(node: fx.Node, env: dict, policy=None, dtypes: dict | None = None) -> str | None:
    """Why ``record_call`` could not splice ``node`` in (as :func:`record_call` says it), or None when it could;
    the graph is left as it is."""
    recorded = _record(node, env, policy, dtypes)
    return recorded if isinstance(recorded, str) else None


def _record(node: fx.Node, env: dict, policy=None, dtypes: dict | None = None):
    """(the recorded graph, its constants, the graph nodes of its inputs), or a one-line reason."""
    from torch.utils.weak import WeakIdKeyDictionary

    from ampaudit.capture.dispatch_capture import WholeLinear, _ModuleStack, _Recorder
    from ampaudit.capture.fx_capture import model_code_only
    from ampaudit.simulate import observing, target_autocast

    flat = _leaves(node)
    if isinstance(flat, str):
        return flat
    leaves, spec = flat
    sub, known, consts = fx.Graph(), WeakIdKeyDictionary(), {}
    inputs, values = [], []
    for v in leaves:
        value = plain(env[v]) if isinstance(v, fx.Node) else v
        low = (dtypes or {}).get(v) if policy is not None and isinstance(v, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.is_floating_point() and isinstance(low, torch.dtype) \
                and low.is_floating_point and low != value.dtype:
            value = value.to(low)        # as autocast hands it over: a .float() inside is then a cast
        if isinstance(value, torch.Tensor) and value not in known:
            known[value] = sub.placeholder(f"a{len(inputs)}")
            inputs.append(v)
        values.append(value)
    args, kwargs = tree_unflatten(values, spec)
    device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
    recorder = _Recorder(sub, _ModuleStack(torch.nn.Module()), known, consts)
    amp = WholeLinear(recorder) if policy is None else target_autocast(policy, device)
    try:
        with torch.no_grad(), amp, observing(recorder.simulated), recorder, model_code_only():
            out = node.target(*args, **kwargs)
    except Exception as exc:
        if policy is not None:
            return _record(node, env)
        # Run at the real shapes, the body still failed: it reads tensor values, which only a real run has.
        return f"{_reason(exc)}; {VALUES_HINT}"
    outs, out_spec = tree_flatten(out)
    if any(isinstance(o, torch.Tensor) and o not in known for o in outs):
        return "it returns a tensor the recording did not see made"
    sub.output(tree_unflatten([known[o] if isinstance(o, torch.Tensor) else o for o in outs], out_spec))
    if not _computes(sub):
        return NOTHING_INSIDE
    return sub, types.SimpleNamespace(**consts), inputs


def _splice(gm: fx.GraphModule, node: fx.Node, sub: fx.Graph, sub_root, inputs: list,
            recorded: bool = False) -> fx.Node:
    graph, depth = gm.graph, node.meta.get(DEPTH_KEY, 0) + 1
    val_map: dict = dict(zip((n for n in sub.nodes if n.op == "placeholder"), inputs))
    after = node.next
    with graph.inserting_before(after):
        for sn in sub.nodes:
            if sn.op == "get_attr" and str(sn.target) not in sub_root.__dict__:
                val_map[sn] = graph.get_attr(str(sn.target))     # gm's own: a weight of a module it was handed
                val_map[sn].meta.update(sn.meta)
            elif sn.op == "get_attr":        # a tensor the body built from constants (torch.tensor(-1e9))
                name = _fresh_name(gm, "_ampaudit_inlined_const")
                value = getattr(sub_root, str(sn.target))
                if isinstance(value, torch.Tensor):   # not in state_dict: the model's checkpoints stay as they are
                    gm.register_buffer(name, value, persistent=False)
                else:
                    setattr(gm, name, value)
                val_map[sn] = graph.get_attr(name)
                val_map[sn].meta.update(sn.meta)
        out = graph.graph_copy(sub, val_map)
    first = node.next
    module, caller_source = module_of(node), source_of(node)
    n = first
    while n is not after:
        n.meta[MODULE_KEY] = module_of(n) or module     # a module the body was handed keeps its own path
        n.meta[SOURCE_KEY] = n.meta.get(SOURCE_KEY) or caller_source
        n.meta[DEPTH_KEY] = depth
        n.meta[RECORDED_KEY] = recorded or bool(n.meta.get(RECORDED_KEY))
        n = n.next
    _rewire(graph, node, out)
    graph.erase_node(node)
    return first if first is not after else after


def _fresh_name(gm: fx.GraphModule, stem: str) -> str:
    i = 0
    while hasattr(gm, f"{stem}{i}"):
        i += 1
    return f"{stem}{i}"


def _rewire(graph: fx.Graph, node: fx.Node, out: Any) -> None:
    """Make ``node``'s users read ``out`` (a node, a constant, or a container of them) instead of ``node``."""
    if isinstance(out, fx.Node):
        node.replace_all_uses_with(out)
        return
    for user in list(node.users):
        key = user.args[1] if len(user.args) == 2 else None
        if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node \
                and isinstance(out, (list, tuple, dict)) and isinstance(key, (int, str)):
            try:
                part = out[key]
            except (IndexError, KeyError, TypeError):
                part = _MISSING
            if part is not _MISSING:
                _rewire(graph, user, part)
                graph.erase_node(user)
                continue
        swap = (lambda a: out if a is node else a)
        user.args = fx.node.map_aggregate(user.args, swap)
        user.kwargs = fx.node.map_aggregate(user.kwargs, swap)


_MISSING = object()


def wrapped_functions() -> list[types.FunctionType]:
    """The user functions registered with ``torch.fx.wrap`` so far."""
    from torch.fx._symbolic_trace import _wrapped_fns_to_patch

    found = [frame.get(name) for (_, name), frame in list(_wrapped_fns_to_patch.items())]
    return [f for f in found if user_function(f)]


@contextlib.contextmanager
def export_anchors():
    """Within this block torch.export's stack traces keep the frames of fx-wrapped user functions.

    Export records only frames named ``forward`` (and registered anchors): the ops of a helper function would
    carry the caller's line, not their own.
    """
    from torch.fx import proxy

    anchors = getattr(proxy, "_STACK_TRACE_ANCHORS", None)
    if anchors is None:            # an older torch records every frame
        yield
        return
    added = {(f.__code__.co_filename, f.__code__.co_name) for f in wrapped_functions()} - anchors
    anchors |= added
    try:
        yield
    finally:
        anchors -= added
