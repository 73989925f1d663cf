"""Capture a model as a torch.fx graph whose nodes know their module path and the user's source line.

    cap = capture(model)                  # Capture(gm, mode="fx")
    for node in cap.gm.graph.nodes:
        module_of(node)                  # "encoder.layers.0.attn" ("" for the top module; ampaudit.graph_meta)
        source_of(node)                  # SourceLoc(file, line, code) or None

A model fx cannot trace raises :class:`CaptureError` naming the user's line that broke tracing.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from ampaudit.errors import CaptureError
from ampaudit.capture.graph_module_paths import GraphModulePaths
from ampaudit.capture.source_lines import SourceLines
from ampaudit.graph_meta import SourceLoc, set_origin
from ampaudit.user_code import is_user_file
from ampaudit.wrappers import unwrap


# The frame that started running the model (see model_code_only): frames further out are its caller's (the CLI,
# typer, pytest, the user's script calling ampaudit.check), not the model's code. With it, the capture's
# SourceLines (which of the frames inside names an op's line: ampaudit.capture.source_lines).
_OUTERMOST = contextvars.ContextVar("ampaudit_outermost_model_frame", default=(None, None))


@contextlib.contextmanager
def model_code_only(root: nn.Module | None = None):
    """Within this block, user_frame() looks no further out than the frame that entered it, and prefers the
    library code of ``root``'s own module classes where no frame is the user's.

    A model made of torch.nn modules alone (a bare ``nn.Linear``) runs no user code at all: its ops then have no
    source line, rather than the line of whatever called the audit.
    """
    # 0: this generator, 1: contextmanager.__enter__, 2: the caller
    token = _OUTERMOST.set((sys._getframe(2), SourceLines(root)))
    try:
        yield
    finally:
        _OUTERMOST.reset(token)


def user_frame() -> SourceLoc | None:
    """The source line of the running op: the innermost frame of the user's code, else of the model's library
    (:class:`ampaudit.capture.source_lines.SourceLines`)."""
    outermost, lines = _OUTERMOST.get()
    return (lines or SourceLines()).of_running(sys._getframe(1), outermost)


def origin_of_running(module: str, paths: GraphModulePaths) -> tuple[str, SourceLoc | None]:
    """The module and source line of the running op, ``module`` (the running module's path) made the recorded
    owner where a user's GraphModule runs the op from its own flat code (``paths``)."""
    module, stack = paths.of_running(module, sys._getframe(1))
    outermost, lines = _OUTERMOST.get()
    lines = lines or SourceLines()
    loc = lines.of_running(sys._getframe(1), outermost)
    return module, loc if loc is not None or not stack else lines.of_stack(stack)


def user_frame_of(tb_or_frames) -> SourceLoc | None:
    """The innermost user frame of a traceback (for errors raised while tracing)."""
    frames = traceback.extract_tb(tb_or_frames) if not isinstance(tb_or_frames, list) else tb_or_frames
    for fr in reversed(frames):
        if is_user_file(fr.filename):
            return SourceLoc(fr.filename, fr.lineno or 0, (fr.line or "").strip())
    return None


class AuditTracer(fx.Tracer):
    """An fx Tracer that stamps every node with the module whose own code created it and the user's line."""

    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self._extra_leaves = leaf_types
        self._paths = GraphModulePaths(None)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if self._extra_leaves and isinstance(m, self._extra_leaves):
            return True
        return super().is_leaf_module(m, qualname)

    def trace(self, root, concrete_args=None):
        # fx would run autocast enter/exit calls while tracing and leave no trace of them; record them instead,
        # so regions a rewrite (or the user) runs with autocast off are known to propagation.
        import torch.amp.autocast_mode as am

        enter, exit_ = am._enter_autocast, am._exit_autocast
        cm_enter, cm_exit = am.autocast.__enter__, am.autocast.__exit__

        def record_enter(ac):  # `with torch.autocast(...)` inside forward
            ac._ampaudit_node = self.create_proxy(
                "call_function", enter, (ac.device, ac.fast_dtype, ac._enabled, ac._cache_enabled), {})
            return ac

        def record_exit(ac, *exc):
            self.create_proxy("call_function", exit_, (ac._ampaudit_node,), {})
            return False

        am._enter_autocast = lambda *vals: self.create_proxy("call_function", enter, vals, {})
        am._exit_autocast = lambda mode: self.create_proxy("call_function", exit_, (mode,), {})
        am.autocast.__enter__, am.autocast.__exit__ = record_enter, record_exit
        self._paths = GraphModulePaths(root)
        try:
            with model_code_only(root if isinstance(root, nn.Module) else None):
                return super().trace(root, concrete_args)
        finally:
            am._enter_autocast, am._exit_autocast = enter, exit_
            am.autocast.__enter__, am.autocast.__exit__ = cm_enter, cm_exit

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "call_module":
            path = str(target)
        else:
            # module_stack holds the modules whose forward is running; the last one owns this op.
            stack = getattr(self, "module_stack", None) or {}
            path = next(reversed(stack), "") if stack else ""
        if kind in ("placeholder", "output"):
            set_origin(node, _strip_wrapper(path), None)
        else:
            set_origin(node, *origin_of_running(_strip_wrapper(path), self._paths))
        return node


@dataclass
class Capture:
    """A captured model: the graph module, how it was captured, and the original root."""

    gm: fx.GraphModule
    mode: str
    root: nn.Module
    notes: list = field(default_factory=list)   # why earlier capture modes failed

    def graph_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The model's inputs as this graph's placeholders take them (export and dispatch graphs take them flat)."""
        if self.mode == "fx":
            return tuple(args), dict(kwargs)
        flat = tree_flatten((tuple(args), dict(kwargs)))[0]
        if self.mode == "dispatch":
            flat = [a for a in flat if isinstance(a, torch.Tensor)]
        return tuple(flat), {}

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph


_WRAPPED = "_ampaudit_root"


def _strip_wrapper(path: str) -> str:
    if path == _WRAPPED:
        return ""
    return path[len(_WRAPPED) + 1:] if path.startswith(_WRAPPED + ".") else path


class _LeafRoot(nn.Module):
    """Holds a root that is itself a torch.nn leaf (a bare nn.LSTM), so it shows up as one call_module node."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        setattr(self, _WRAPPED, inner)


def _wrap_leaf(inner: nn.Module) -> nn.Module:
    # fx reads placeholders from forward's code object, so *args will not do: spell out the inner signature.
    import inspect

    params = [p for p in inspect.signature(inner.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = {f"_d{i}": p.default for i, p in enumerate(params) if p.default is not p.empty}
    sig = ", ".join(p.name + (f"=_d{i}" if f"_d{i}" in defaults else "") for i, p in enumerate(params))
    call = ", ".join(p.name for p in params)
    ns = dict(defaults)
    exec(f"def forward(self, {sig}):\n    return getattr(self, {_WRAPPED!r})({call})\n", ns)
    cls = type("_LeafRoot", (_LeafRoot,), {"forward": ns["forward"]})
    return cls(inner)


def capture(model: nn.Module, *, concrete_args: dict | None = None,
            leaf_types: tuple[type, ...] = ()) -> Capture:
    """Trace ``model`` with torch.fx; raise CaptureError naming the user's line when tracing fails."""
    model = unwrap(model)
    tracer = AuditTracer(leaf_types)
    if tracer.is_leaf_module(model, ""):
        model = _wrap_leaf(model)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        loc = user_frame_of(exc.__traceback__)
        where = f" at {Path(loc.file).name}:{loc.line} ({loc.code})" if loc else ""
        reason = " ".join(str(exc).split())[:200]
        raise CaptureError(f"torch.fx cannot trace {type(model).__name__}{where}: {type(exc).__name__}: {reason}",
                           hint="make that line independent of tensor values, or mark the module as a leaf") from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    return Capture(gm=gm, mode="fx", root=model)
