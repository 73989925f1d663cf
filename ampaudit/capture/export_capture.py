"""Capture with torch.export (non-strict), for models torch.fx cannot trace (Hugging Face models, most timm).

    cap = capture_export(model, args, kwargs)     # Capture(gm, mode="export")

The exported graph holds pre-dispatch aten ops (aten.linear, aten.softmax, aten.layer_norm) with parameters as
get_attr nodes under their original names; each node's ``nn_module_stack`` and ``stack_trace`` give the module
path and the op's line (the user's, else the model library's), which are written to the same meta keys the fx
capture writes.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import re

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from ampaudit.capture.fx_capture import Capture
from ampaudit.capture.grad_regions import inline_grad_regions
from ampaudit.capture.graph_module_paths import GraphModulePaths
from ampaudit.capture.source_lines import SourceLines
from ampaudit.graph_meta import set_origin
from ampaudit.errors import CaptureError
from ampaudit.policy import Policy
from ampaudit.simulate import target_autocast

# Checks export inserts; they compute nothing.
_ASSERTS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def module_path(raw: str) -> str:
    """``L['self'].blocks[0].attn`` / ``L__self___blocks_0`` / ``blocks.0.attn`` -> ``blocks.0.attn``."""
    path = raw.replace("L['self']", "").replace("L__self__", "")
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    path = re.sub(r"\._modules\.", ".", path)
    return path.strip("._")


def annotate(gm: fx.GraphModule, root: nn.Module | None = None) -> None:
    """Write MODULE_KEY and SOURCE_KEY on every node from ``nn_module_stack`` and ``stack_trace`` (the stack's
    line: the user's, else that of ``root``'s library, as :class:`SourceLines` picks it)."""
    lines, paths = SourceLines(root), GraphModulePaths(root)
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        path = paths.of_stack(module_path(list(stack.values())[-1][0]) if stack else "", n.meta.get("stack_trace"))
        set_origin(n, path, lines.of_stack(n.meta.get("stack_trace")))


@contextlib.contextmanager
def _quiet():
    # A failed export logs warnings and whole graph dumps; a fallback follows, so the user needs none of it.
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


class TooDataDependent(RuntimeError):
    """An export attempt stopped after creating more data-dependent sizes than ``unbacked_limit`` allows."""


@contextlib.contextmanager
def _unbacked_budget(limit: int | None):
    """Stop an export once it has made more than ``limit`` data-dependent (unbacked) sizes: each later op on them
    costs tens of milliseconds of symbolic reasoning, and a forward that keeps making them is a detection head
    (SSD: one per class, then a guard on their sum that fails, after 10 s). None: no limit."""
    if limit is None:
        yield
        return
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    names = ("create_unbacked_symint", "create_unbacked_symfloat", "create_unbacked_symbool")
    real = {name: getattr(ShapeEnv, name) for name in names}
    made = [0]

    def counted(name):
        def create(self, *args, **kwargs):
            made[0] += 1
            if made[0] > limit:
                raise TooDataDependent(f"stopped after {limit} data-dependent sizes (outputs whose size depends on "
                                       "tensor values, as nonzero and boolean masks give)")
            return real[name](self, *args, **kwargs)
        return create

    for name in names:
        setattr(ShapeEnv, name, counted(name))
    try:
        yield
    finally:
        for name in names:
            setattr(ShapeEnv, name, real[name])


def _export(model: nn.Module, args: tuple, kwargs: dict, policy: Policy | None, unbacked_limit: int | None = None):
    from ampaudit.capture.opaque import export_anchors

    with _quiet(), export_anchors(), _unbacked_budget(unbacked_limit):
        return _export_loud(model, args, kwargs, policy)


def _export_loud(model: nn.Module, args: tuple, kwargs: dict, policy: Policy | None):
    tensors = [*model.parameters(), *model.buffers()]
    if policy is not None and any(t.is_meta for t in tensors):    # meta wins, as in AmpProp.param_device
        return _export_meta(model, args, kwargs, policy)
    device_type = tensors[0].device.type if tensors else "cpu"
    if policy is None or device_type not in ("cpu", "cuda"):
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    with target_autocast(policy, device_type), _lazy_code():
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False)


def _lazy_code():
    """While active, the graph modules torch.export makes generate their code when it is first needed, not on
    each ``recompile()``. Under autocast, a forward's own ``torch.autocast`` blocks (efficientvit's fp32
    attention) become export nodes, and export's pass that wraps them splits the graph and recompiles each piece
    (106 times for efficientvit_b0: 0.30 of the pass's 0.36 CPU s under cProfile); the unlifting generates the
    final graph's code once."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    # A CPU tensor of t's shape, strides and dtype (the strides decide which later views are legal). Its memory is
    # never written, the trace only reads shapes, so the OS backs none of it: a 7B model's stand-ins cost no RAM.
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _export_meta(model: nn.Module, args: tuple, kwargs: dict, policy: Policy):
    """Export a meta-built model under the target's autocast: autocast does not act on meta tensors, so a meta
    export would bake ``finfo(x.dtype)`` and ``.to(x.dtype)`` as fp32's. The model's meta weights and buffers
    (and meta inputs) are swapped for CPU stand-ins for the trace, then put back, also in the exported program."""
    originals: dict[int, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def cpu(t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        if id(t) not in made:        # tied weights stay one tensor
            made[id(t)] = _stand_in(t)
            originals[id(made[id(t)])] = t
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None and t.is_meta:
                    swapped.append((table, name, t))
                    table[name] = cpu(t)
    try:
        args, kwargs = tree_map(cpu, (tuple(args), dict(kwargs)))
        with target_autocast(policy, "cpu"), _lazy_code():
            ep = torch.export.export(model, args, kwargs, strict=False)
    finally:
        for table, name, t in swapped:
            table[name] = t
    for table in (ep.state_dict, ep.constants):      # non-persistent buffers (rotary inv_freq) are constants
        for name, t in list(table.items()):
            table[name] = originals.get(id(t), t)
    # Tensors the forward makes (arange(device=key.device)) were baked on the stand-ins' CPU: back to meta, or
    # the propagation's meta run would mix devices.
    # (No recompile: :func:`unlifted` builds its module from this graph and generates the code then.)
    meta = torch.device("meta")
    for n in ep.graph.nodes:
        n.args, n.kwargs = tree_map(lambda v: meta if isinstance(v, torch.device) and v.type == "cpu" else v,
                                    (n.args, n.kwargs))
    return ep


def _causes(exc: BaseException | None):
    """``exc`` and the errors it was raised ``from``: export re-raises some errors from the one that stopped it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__     # not __context__: an error raised while one was being handled is its own


def unlifted(ep) -> fx.GraphModule:
    """The exported program as a module whose parameters are get_attr nodes under their original names, without
    ``ep.module()``'s input guards (:func:`unlifted_in_place`, else ``ep.module(check_guards=False)`` where this
    torch has that argument, else ``ep.module()``, whose guard call :func:`capture_export` erases)."""
    gm = unlifted_in_place(ep)
    if gm is not None:
        return gm
    if "check_guards" in inspect.signature(type(ep).module).parameters:
        return ep.module(check_guards=False)
    return ep.module()


def unlifted_in_place(ep) -> fx.GraphModule | None:
    """``ep.module()``'s unlifting, by torch's own ``_unlift`` on a copy of ``ep``'s graph (the same nodes,
    names and mutation copies), less the rest of ``module()``: that builds two more graph modules and generates
    and compiles the code three times, 0.33 of a 1,489-node capture's 2.5 CPU s (efficientvit_m0,
    bench/check_stages.py). Here the module is lazy (its code is generated if something calls it) and a plain
    graph module, without the exported module's input checks. None where this torch lacks the pieces or the
    program is not the training IR ``torch.export.export`` gives."""
    try:
        from torch.export._unlift import _register_attrs_to_new_gm, _unlift
        from torch.export.graph_signature import InputKind, OutputKind
        from torch.export.unflatten import _assign_attr, _AttrKind
        from torch.fx._lazy_graph_module import _LazyGraphModule
        from torch.fx.graph_module import _has_attr
    except ImportError:        # pragma: no cover - another torch: ep.module() does it
        return None
    sig = ep.graph_signature
    if ep.verifiers[0].dialect != "TRAINING" or ep.call_spec.in_spec is None:
        return None
    lifted = (InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.PARAMETER, InputKind.CUSTOM_OBJ)
    mutations = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION, OutputKind.PARAMETER_MUTATION)
    # A copy, as module() makes: names freed by export's own passes (a constant's get_attr it lifted) are free
    # again in it, so each node is named as module() names it.
    gm = _LazyGraphModule(ep.graph_module, copy.deepcopy(ep.graph))
    gm.meta.update(ep.graph_module.meta)
    call = ep.module_call_graph[0].signature
    try:
        _register_attrs_to_new_gm(gm, sig, ep.state_dict, ep.constants)
        _unlift(gm, [s.target if s.kind in lifted else None for s in sig.input_specs],
                [s.target if s.kind in mutations else None for s in sig.output_specs],
                ep.call_spec.in_spec, ep.call_spec.out_spec,
                forward_arg_names=call.forward_arg_names if call else None)
    except (TypeError, AttributeError):    # private helpers whose signature another torch changed: module() does it
        return None
    for name, value in ep.constants.items():    # as module() keeps them: a constant needs no gradient
        if not _has_attr(gm, name):
            value = value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value
            _assign_attr(value, gm, name, attr_kind=_AttrKind.CONSTANT)
    return gm


def data_dependent(exc: BaseException) -> bool:
    """Whether export failed on control flow or an output size that depends on tensor values (detection models'
    NMS). The dtypes do not change that, so an export without autocast would fail the same way, a second
    full trace later (as long as the first: half of a detection model's check)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException,
             TooDataDependent)
    return any(isinstance(e, kinds) for e in _causes(exc))


# What torch (torch/_functorch/_aot_autograd/utils.py) raises once the whole forward is traced, when it returns
# an object pytree cannot flatten (a transformers cache class): no dtype changes the type a forward returns.
_UNKNOWN_OUTPUT = re.compile(r"^Found <class '[^']+'> in output, which is not a known type\.")


def unflattenable_output(exc: BaseException) -> bool:
    """Whether export failed because the forward returns a type torch.export cannot flatten (Whisper's
    ``EncoderDecoderCache``)."""
    return any(isinstance(e, RuntimeError) and _UNKNOWN_OUTPUT.match(str(e)) for e in _causes(exc))


def fails_in_any_dtype(exc: BaseException) -> bool:
    """Whether an export under autocast failed for a reason the dtypes do not touch (:func:`data_dependent`,
    :func:`unflattenable_output`), so an fp32 export would fail the same way after a second full trace."""
    return data_dependent(exc) or unflattenable_output(exc)


def capture_export(model: nn.Module, args: tuple, kwargs: dict, *, policy: Policy | None = None,
                   unbacked_limit: int | None = None) -> Capture:
    """torch.export.export(strict=False), unlifted so parameters are get_attr nodes with their original names.

    ``unbacked_limit``: give up (CaptureError) once the export has made more data-dependent sizes than this;
    :func:`ampaudit.capture.capture_any` sets it when the dispatch capture follows (None: export to the end).

    Exporting under ``policy``'s autocast (:func:`ampaudit.simulate.target_autocast`) bakes ``.to(x.dtype)`` as
    the dtype x has under the target's autocast (an fp32 export would bake fp32); the graph's ops are still the
    un-autocast aten ops, which the policy tables then type.
    """
    try:
        try:
            ep = _export(model, args, kwargs, policy, unbacked_limit)
        except Exception as first:
            if policy is None or fails_in_any_dtype(first):
                raise
            ep = _export(model, args, kwargs, None, unbacked_limit)
        gm = unlifted(ep)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CaptureError(f"torch.export cannot capture {type(model).__name__}: {type(exc).__name__}: {reason}",
                           hint="the dispatch-level capture is tried next") from exc
    erased = inline_grad_regions(gm)   # no_grad blocks: their ops, audited like the rest
    # export adds a guard-checking submodule call with no users: not part of the model.
    for n in list(gm.graph.nodes):
        if n.users:
            continue
        if n.op == "call_module" and "guard" in str(n.target) or getattr(n.target, "_opname", "") in _ASSERTS:
            gm.graph.erase_node(n)
            erased += 1
    annotate(gm, model)
    gm.graph.lint()
    if erased:        # the module's code still calls what was erased; unchanged, it is the graph's already
        gm.recompile()
    return Capture(gm=gm, mode="export", root=model)
