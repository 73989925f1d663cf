"""AmpProp: shape and dtype propagation under a target autocast policy, without weight values.

Written like ``torch.fx.passes.shape_prop``: an Interpreter that runs the graph on fake tensors (FakeTensorMode, so
no memory is allocated for activations or weights; meta-device models work) and writes one ``node.meta`` key,
``"amp"``, an :class:`AmpInfo`::

    gm = capture(model).gm
    AmpProp(gm, Policy.load("cuda", "float16")).propagate(*args, **kwargs)
    info = node.meta["amp"]       # op, shape, dtype (under autocast), compute_dtype, category, module, source

The fake run itself is in fp32 (the model as written); the autocast dtypes are a second track computed from the
policy tables: lower ops produce the low dtype, fp32 ops fp32, unlisted ops follow torch's type promotion of their
tensor inputs, and explicit casts (``.float()``, ``.to(x.dtype)``) win. ``x.dtype`` resolves to x's autocast dtype,
so masks built with ``.to(scores.dtype)`` get the dtype they would really have.

A call of a function fx keeps opaque (``torch.fx.wrap``) is replaced by its body on the way
(:mod:`ampaudit.capture.opaque`), so the rules see its ops with its own lines; ``specialize=False`` splices only
bodies that hold for every input (what ``fix`` rewrites), never one recorded at these inputs' shapes.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from ampaudit.graph_meta import SourceLoc, module_of, source_of
from ampaudit.analysis.meta_memo import MetaMemo
from ampaudit.analysis.prop_fallbacks import raise_if_real_kernel_raises, recorded_output, reshaped_view
from ampaudit.analysis.mixed_dtypes import NO_KERNEL as _NO_KERNEL, raises_at_autocast_dtypes, run_promoted
from ampaudit.capture.opaque import NOTHING_INSIDE, inline_call, plain, record_call, unrecordable, user_function
from ampaudit.dtypes import by_name
from ampaudit.errors import InputError
from ampaudit.policy import Policy, op_names

AMP_KEY = "amp"

# Tensor methods that cast (x.float(), x.half()): each method is named after its dtype.
_CAST_TARGETS = {m: by_name(m) for m in ("float", "half", "bfloat16", "double")}



@dataclass
class AmpInfo:
    """What ``AmpProp`` knows about one node."""

    op: str
    category: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None            # output dtype under the target autocast policy
    compute_dtype: torch.dtype | None = None    # dtype the op's arithmetic runs in under the policy
    input_shapes: list = field(default_factory=list)
    input_dtypes: list = field(default_factory=list)
    module: str = ""
    module_type: str | None = None
    source: SourceLoc | None = None
    error: str | None = None                    # why shapes are unknown here, if they are
    raises: str | None = None                   # the kernel's error on the dtypes autocast gives its inputs
    raises_dtypes: list = field(default_factory=list)   # the floating dtypes it met then
    value: Any = None                           # the fake output (tensors carry shapes only)


def canonical_op(node: fx.Node, root: torch.nn.Module) -> tuple[str, str | None]:
    """(canonical op name, module class name) of a node, using rules/policy/ops.toml."""
    names = op_names()
    if node.op == "call_module":
        cls = type(root.get_submodule(node.target)).__name__
        return names["modules"].get(cls, cls.lower()), cls
    if node.op == "call_function":
        # aten OpOverloads (export and dispatch captures) are named by their packet: aten.softmax.int -> softmax
        raw = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", str(node.target))
    elif node.op == "call_method":
        raw = str(node.target)
    else:
        return node.op, None
    first = node.args[0] if node.args else None
    if isinstance(first, (int, float)) and not isinstance(first, bool) and raw in names.get("number_first", {}):
        return names["number_first"][raw], None
    raw = names["aliases"].get(raw, raw)
    return names["aliases"].get(raw.strip("_"), raw.strip("_")) if raw.startswith("__") else raw, None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def _promote(dtypes: list[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """torch's promotion for (dtype, ndim) pairs: dimensioned tensors win over 0-dim ones of the same category."""
    floats = [(d, nd) for d, nd in dtypes if d.is_floating_point]
    if not floats:
        return None
    ranked = [d for d, nd in floats if nd > 0] or [d for d, _ in floats]
    out = ranked[0]
    for d in ranked[1:]:
        out = torch.promote_types(out, d)
    return out


class AmpProp(fx.Interpreter):
    """Interpreter writing ``node.meta["amp"]``; call :meth:`propagate` with the example inputs."""

    def __init__(self, gm: fx.GraphModule, policy: Policy, *, specialize: bool = True):
        super().__init__(gm)
        self.policy = policy
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.amp_dtype: dict[fx.Node, Any] = {}   # node -> autocast dtype (tensor outputs) or dtype value
        self.ndim: dict[fx.Node, int] = {}        # tensor-valued nodes -> ndim (0-dim tensors promote weakly)
        self.unknown: list[fx.Node] = []
        self.autocast_stack: list[bool] = []     # enabled flags of recorded autocast regions, innermost last
        self.specialize = specialize
        self.notes: list[str] = []               # what propagation could not look into
        self.recordable: list[str] = []          # of those (specialize=False), what a specialized run records
        self.probe_memo: dict = {}              # op signature -> the mixed-dtype probe's verdict
        self._device: torch.device | None = None
        self._memo: MetaMemo | None = None        # while a meta-device graph propagates

    # -- entry point -----------------------------------------------------------------------------------------
    def propagate(self, *args, **kwargs) -> fx.GraphModule:
        device = self.param_device()
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        bound = self._bind(placeholders, args, kwargs)

        if device.type == "meta":
            # Weights already hold no data: plain meta tensors propagate shapes ~3x faster than fake tensors.
            meta_args = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, bound)
            self._memo = MetaMemo()
            try:
                with torch.no_grad():
                    self.run(*meta_args)
            finally:
                self._memo = None
            return self.module

        def to_fake(x):
            if isinstance(x, torch.Tensor):
                return self.fake_mode.from_tensor(x.to(device) if x.device != device else x)
            return x

        fake_args = tree_map(to_fake, bound)
        with self.fake_mode, torch.no_grad(), _quiet_fake_tensor_log():
            self.run(*fake_args)
        return self.module

    def param_device(self) -> torch.device:
        # Asked for each node whose recorded output is used: walking every weight each time was a tenth of a
        # detection model's check, and the weights do not move while the graph propagates.
        if self._device is None:
            tensors = list(self.module.parameters()) + list(self.module.buffers())
            # A model built under `with torch.device("meta")` can still hold a CPU tensor (torch.Tensor(n) ignores
            # the device context; wav2vec2's masked_spec_embed is one): its meta weights have no data to copy, so
            # meta wins.
            self._device = torch.device("meta") if any(t.is_meta for t in tensors) else \
                tensors[0].device if tensors else torch.device("cpu")
        return self._device

    def _bind(self, placeholders: list[fx.Node], args: tuple, kwargs: dict) -> list:
        values = list(args)
        for ph in placeholders[len(args):]:
            if ph.target in kwargs:
                values.append(kwargs[ph.target])
            elif ph.args:  # default value recorded by the tracer
                values.append(ph.args[0])
            else:
                raise InputError(f"no example input for forward argument {ph.target!r}",
                                 hint="add it to example_inputs(), or pass one --input per argument")
        return values[: len(placeholders)]

    # -- per node --------------------------------------------------------------------------------------------
    def run_node(self, n: fx.Node) -> Any:
        op, cls = canonical_op(n, self.module)
        info = AmpInfo(op=op, module=module_of(n), module_type=cls, source=source_of(n))
        self._track_autocast(n)
        off = self.autocast_stack and not self.autocast_stack[-1]
        info.category = self.policy.category(op) if n.op in ("call_module", "call_function", "call_method") \
            and not off else None
        inputs = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)]
        info.input_shapes = [getattr(a.meta.get(AMP_KEY), "shape", None) for a in inputs]
        info.input_dtypes = [self.amp_dtype.get(a) for a in inputs]
        try:
            result = super().run_node(n)
        except Exception as exc:  # an op without a fake kernel: shapes downstream are unknown, dtypes still flow
            result = recorded_output(self, n)
            if result is None:
                result = reshaped_view(self, n, exc)
            if result is None and n.op != "placeholder" and not isinstance(exc, _NO_KERNEL):
                # The model mixes dtypes itself (x.half() meets an fp32 weight), as only autocast lets it run:
                # shapes go on from the promoted inputs; whether the target's autocast runs it is judged below.
                result = run_promoted(self, n)
                if result is None:
                    raise_if_real_kernel_raises(self, n, op)
            if result is None:
                info.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
                self.unknown.append(n)
            if n.op == "placeholder":
                raise
        tensors = _tensors(result)
        if tensors:
            info.shape = tuple(tensors[0].shape)
        info.value = result if n.op not in ("placeholder", "get_attr") or tensors else None
        self._dtype_track(n, info, result, inputs)
        if result is not None:
            info.raises, info.raises_dtypes = raises_at_autocast_dtypes(self, n, info.category) or (None, [])
        n.meta[AMP_KEY] = info
        if result is None and info.error:
            raise _Unknown(n)
        return result

    def run(self, *args, **kwargs):
        # Like Interpreter.run, but a node without a fake kernel only blanks the nodes that depend on it.
        self.env = {}
        args_iter = iter(args)
        node = next(iter(self.graph.nodes), None)
        # Walked by hand: a wrapped function's body is spliced in after its node, and is walked next.
        while node is not None and node.op not in ("output", "root"):
            node, current = node.next, node
            if current.op == "call_function" and user_function(current.target):
                spliced = self._descend(current)
                if spliced is not None:
                    node = spliced
                    continue
            self._run_one(current, args_iter)
        return None

    def _run_one(self, node: fx.Node, args_iter) -> None:
        if node.op == "placeholder":
            self.args_iter = args_iter
        if any(isinstance(a, fx.Node) and a not in self.env for a in tree_flatten((node.args, node.kwargs))[0]):
            node.meta[AMP_KEY] = AmpInfo(op=canonical_op(node, self.module)[0], module=module_of(node),
                                         source=source_of(node), error="input shape unknown")
            self._dtype_track(node, node.meta[AMP_KEY], None,
                              [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)])
            return
        try:
            self.env[node] = self.run_node(node)
        except _Unknown:
            return

    def _descend(self, n: fx.Node) -> fx.Node | None:
        """Splice the body of the user function ``n`` calls into the graph; the first spliced node, or None when
        ``n`` stays one opaque call (its body computes no tensor op, or cannot be traced: then noted)."""
        spliced = inline_call(self.module, n)
        inputs = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)]
        recordable = False
        if isinstance(spliced, str) and spliced != NOTHING_INSIDE and all(a in self.env for a in inputs):
            # Control flow on a shape (Swin's window sizes): the ops these inputs run, recorded (without
            # specialize, only whether they could be, which a specialized audit then sees).
            if self.specialize:
                spliced = record_call(self.module, n, self.env, self.policy, self.amp_dtype)
            else:
                why = unrecordable(n, self.env, self.policy, self.amp_dtype)
                recordable, spliced = why is None, spliced if why is None else why
        if isinstance(spliced, fx.Node):
            return spliced
        note = f"{n.target.__name__} is not audited inside (fx keeps it opaque: {spliced})"
        if spliced != NOTHING_INSIDE and note not in self.notes:    # once, not once per block calling it
            self.notes.append(note)
            if recordable:
                self.recordable.append(note)
        return None

    def call_function(self, target, args, kwargs):
        if user_function(target):      # the user's own Python: give it the plain lists it is written for
            args, kwargs = plain((args, kwargs))
        if self._memo is not None:
            return self._memo.call(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def _track_autocast(self, n: fx.Node) -> None:
        """Follow recorded ``_enter_autocast(device, dtype, enabled, cache)`` / ``_exit_autocast`` pairs."""
        import torch.amp.autocast_mode as am

        if n.op != "call_function":
            return
        if n.target is am._enter_autocast:
            enabled = n.args[2] if len(n.args) > 2 else n.kwargs.get("enabled", True)
            self.autocast_stack.append(bool(enabled))
        elif n.target is am._exit_autocast and self.autocast_stack:
            self.autocast_stack.pop()

    # -- the autocast dtype track ----------------------------------------------------------------------------
    def _dtype_track(self, n: fx.Node, info: AmpInfo, result: Any, inputs: list[fx.Node]) -> None:
        ts = _tensors(result)
        if n.op in ("placeholder", "get_attr"):
            out = ts[0].dtype if ts else None
            info.dtype = self.amp_dtype[n] = out
            if ts:
                self.ndim[n] = ts[0].dim()
            return
        if n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] == "dtype":
            self.amp_dtype[n] = self.amp_dtype.get(n.args[0])  # x.dtype is x's autocast dtype
            return
        if result is not None and not ts:  # shapes, ints, None: not a tensor, nothing to autocast
            self.amp_dtype[n] = None
            return
        tensor_in = [(self.amp_dtype[a], self.ndim[a]) for a in inputs
                     if a in self.ndim and isinstance(self.amp_dtype.get(a), torch.dtype)]
        cat, low = info.category, self.policy.low
        explicit = self._explicit_dtype(n)
        if ts and not ts[0].dtype.is_floating_point:  # indices, masks, shapes: autocast leaves them alone
            out, compute = ts[0].dtype, _promote(tensor_in)
        elif cat == "lower":
            out = explicit or low
            compute = self.policy.gemm_dtype if self.policy.gemm_dtype is not None and info.op in _GEMM_OPS else low
        elif cat in ("fp32", "fp32_output"):
            out, compute = explicit or torch.float32, torch.float32
        elif explicit is not None:
            # .to(dtype)/.float() compute nothing; softmax(..., dtype=torch.float32) computes in that dtype.
            is_cast = n.op == "call_method" and (n.target in _CAST_TARGETS or n.target in ("to", "type", "type_as"))
            out = explicit
            compute = (_promote(tensor_in) or explicit) if is_cast else explicit
        elif info.op in op_names()["follows_first_input"]["ops"] and tensor_in and n.op != "call_module":
            out = compute = tensor_in[0][0]
        else:  # promote, banned, or unlisted: torch's type promotion of the tensor inputs
            compute = _promote(tensor_in)
            if compute is None:
                params = list(self.module.get_submodule(n.target).parameters()) if n.op == "call_module" else []
                compute = params[0].dtype if params else (ts[0].dtype if ts else None)
            out = compute
        info.dtype, info.compute_dtype = out, compute
        self.amp_dtype[n] = out
        if ts:
            self.ndim[n] = ts[0].dim()
        elif result is None and isinstance(out, torch.dtype):
            self.ndim[n] = 1  # shape unknown, but a tensor all the same

    def _explicit_dtype(self, n: fx.Node) -> torch.dtype | None:
        if n.op == "call_method" and n.target in _CAST_TARGETS:
            return _CAST_TARGETS[n.target]
        if n.op == "call_method" and n.target in ("to", "type", "type_as") or n.op == "call_function" and getattr(
                n.target, "_opname", None) in ("to", "_to_copy", "type_as"):
            for a in list(n.args[1:]) + list(n.kwargs.values()):
                if isinstance(a, torch.dtype):
                    return a
                if isinstance(a, fx.Node):
                    d = self.amp_dtype.get(a)
                    if isinstance(d, torch.dtype):
                        return d
            return None
        dt = n.kwargs.get("dtype")
        if isinstance(dt, torch.dtype):
            return dt
        if isinstance(dt, fx.Node) and isinstance(self.amp_dtype.get(dt), torch.dtype):
            return self.amp_dtype[dt]
        return None


_GEMM_OPS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d"}


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    # FakeTensorMode logs a traceback for every kernel that raises; AmpProp reports those itself (or notes them).
    log = logging.getLogger(fake_tensor.__name__)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


class _Unknown(Exception):
    def __init__(self, node: fx.Node):
        super().__init__(node.format_node())
