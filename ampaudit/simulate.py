"""CUDA autocast on a CPU: a CPU-autocast forward in which every op gets the dtype CUDA autocast would give it.

    with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
        out = model(x)      # GEMMs in fp16; softmax, exp, sum, layer_norm, x.norm() (F.normalize's) in fp32
    sim.notes               # what had to be approximated: ops CPU has no float16 kernel for

:func:`target_autocast` is what every stage that means "under the target" runs in (capture, propagation
probes, calibration, fix verification); :class:`PolicyUpcast` is the simulation inside it.

Autocast is a dispatch key. An aten op called on CPU tensors meets the AutocastCPU key, whose kernel for that op
(if any) casts the inputs by CPU's policy; CUDA's policy is registered on AutocastCUDA, a key CPU tensors never
meet. Both work on aten ops, below the Python layer, so an op is handled however a model reaches it:
``torch.norm(x)``, ``x.norm()``, ``F.normalize(x)`` (which calls ``x.norm``), ``nn.Softmax``. And a composite op
(cosine_similarity, layer_norm, rms_norm) is cast before it decomposes, so everything inside it runs in the cast
dtype. A ``TorchFunctionMode`` sees only the outermost Python call (not ``F.normalize``'s ``x.norm``); a
``TorchDispatchMode`` only the decomposed ops, after CPU autocast has already cast them.

So the simulation works on the same key: for its duration :class:`PolicyUpcast` registers Python kernels on
AutocastCPU that apply CUDA's policy, for each aten op where CUDA's handling differs from CPU's. *Which* aten ops
CUDA autocast handles is read from torch's own registrations (the AutocastCUDA kernels are in CPU builds too);
*how* (lower, fp32, fp32_output, promote, banned) comes from rules/policy/cuda.toml, the table the static audit
types its graph with, through the aliases of rules/policy/ops.toml. An op CPU autocast casts and CUDA's does not
(max_pool3d, grid_sampler, cat) gets a fallthrough, as on CUDA. The casts follow
aten/src/ATen/autocast_mode.h: only floating tensors other than float64 are cast; fp32_output sets an unset
``dtype`` argument to float32 (norm, which has none, gets its input upcast: the same numbers).

CPU lacks a few float16 kernels that CUDA has (torch's "not implemented for 'Half'", oneDNN's "could not create
a primitive descriptor" for nn.LSTM: :mod:`ampaudit.machine.kernels`). Under the simulation such an op is computed
in fp32 and rounded to the low dtype, and a note says which op (:func:`ampaudit.notes.note`, and ``sim.notes``).
A CPU target uses none of this: there the forward stops at the op, and calibration notes that this machine lacks
the kernel (another CPU may have it). The registrations are process-wide while active: do not run other
CPU-autocast work on another thread meanwhile.

Some CPU half kernels exist but are slow reference kernels: fp16 ``convolution_backward`` (every conv's
backward) runs 5-300x slower than fp32, and so do the fp16 ``convolution`` forward and GEMMs (mm, addmm, bmm) on
a CPU without avx512_fp16 (where it has one, they are oneDNN's and fast). CUDA's kernel (cuDNN, cuBLAS)
reads the half inputs, accumulates in fp32 and rounds its outputs to half, so under the simulation the ops
rules/policy/kernels.toml lists in ``simulated_in_fp32`` are computed exactly so: fp32 on the half inputs, each
output rounded once, without a note (nothing is approximated); the fp16 attention backward, whose CUDA kernels
also round the probabilities to half, is computed with those kernels' steps (:mod:`ampaudit.cuda_attention`).
A CPU target keeps CPU's own kernels.
"""
from __future__ import annotations

import contextlib
import re
from functools import lru_cache
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from ampaudit import cuda_attention
from ampaudit.dtypes import is_half, name_of
from ampaudit.machine.kernels import kernel_gap
from ampaudit.notes import note
from ampaudit.policy import Policy, kernels, op_names
from ampaudit.quiet import quiet

_KEY = "AutocastCPU"


@lru_cache(maxsize=None)
def autocast_ops(key: str) -> frozenset[str]:
    """Qualified names (``aten::norm.Scalar``) of the aten ops with a kernel on dispatch key ``key``."""
    registered = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if registered is not None:     # one call; asking each of ~3,000 ops was 0.03 CPU s of every simulation's start
        return frozenset(name for name in registered(key) if name.startswith("aten::"))
    return frozenset(name for name in torch._C._dispatch_get_all_op_names()  # pragma: no cover - older torch
                     if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


def packet(qualified: str) -> str:
    """``aten::norm.Scalar`` -> ``norm``."""
    return qualified.split("::", 1)[1].split(".", 1)[0]


def category(policy: Policy, qualified: str) -> str | None:
    """``policy``'s category for an aten op, named the way the static audit names it (ops.toml aliases)."""
    name = packet(qualified)
    return policy.category(op_names()["aliases"].get(name, name))


@lru_cache(maxsize=None)
def overrides(device: str, dtype: str) -> dict[str, str | None]:
    """Aten op -> the category the simulation applies on AutocastCPU (None: a fallthrough, the op runs uncast),
    for each op ``device``'s autocast handles differently from CPU's.

    ``device`` handles the ops torch registers on its autocast key, and ops CPU registers that its table names
    (mkldnn_rnn_layer, CPU's counterpart of cuDNN's RNN). An op it registers that its table does not name keeps
    CPU's handling (a test keeps that list empty)."""
    target, cpu = Policy.load(device, dtype), Policy.load("cpu", dtype)
    registered, cpu_ops = autocast_ops("Autocast" + device.upper()), autocast_ops(_KEY)
    out: dict[str, str | None] = {}
    for op in sorted(registered | cpu_ops):
        want = category(target, op)
        handled = op in registered or want is not None
        if op in registered and want is None:
            continue
        want = want if handled else None
        have = category(cpu, op) if op in cpu_ops else None
        if want != have or (op in cpu_ops and not handled):
            out[op] = want
    return out


def _overload(qualified: str) -> torch._ops.OpOverload:
    name, _, overload = qualified.split("::", 1)[1].partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _eligible(t: Any) -> bool:
    # autocast_mode.h is_eligible: a floating tensor of the autocast's device, float64 excepted.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == "cpu"


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t, tree)


def _dtype_at(op: torch._ops.OpOverload) -> int | None:
    names = [a.name for a in op._schema.arguments]
    return names.index("dtype") if "dtype" in names else None


# Who wants to see each call a policy kernel runs (innermost last): see observing().
_OBSERVERS: list[Callable] = []


@contextlib.contextmanager
def observing(observer: Callable) -> Iterator[None]:
    """While active, each op a policy kernel of the simulation handles is handed to
    ``observer(op, args, kwargs, run)``, with ``args``/``kwargs`` as the model passed them (before the kernel's
    casts); ``run()`` runs it as simulated and returns the output, which the observer returns. A dispatch-level
    recorder records the model's own call there (one node, where a composite op such as softmax would show
    only the casts and pieces it decomposes into), and the static policy types it."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def _kernel(op: torch._ops.OpOverload, how: str | None) -> Callable:
    """The AutocastCPU kernel applying CUDA's policy ``how`` to ``op``, then running it below autocast."""
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    at = _dtype_at(op)

    def kernel(*args, **kwargs):
        if _OBSERVERS:
            return _OBSERVERS[-1](op, args, kwargs, lambda: _apply(*args, **kwargs))
        return _apply(*args, **kwargs)

    def _apply(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            if how == "lower":
                args, kwargs = _cast((args, kwargs), torch.get_autocast_dtype("cpu"))
            elif how == "fp32":
                args, kwargs = _cast((args, kwargs), torch.float32)
            elif how == "fp32_output" and args and _eligible(args[0]):
                if at is None:               # fp32_append_dtype (norm): the dtype overload upcasts the input
                    args = (args[0].float(),) + tuple(args[1:])
                elif at < len(args):
                    args = tuple(args[:at]) + (torch.float32 if args[at] is None else args[at],) + tuple(args[at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif how == "promote":
                # The widest floating input wins; CUDA raises on fp16 mixed with bf16, this gives fp32.
                low = torch.get_autocast_dtype("cpu")
                wide = any(_eligible(t) and t.dtype != low for t in tree_leaves((args, kwargs)))
                args, kwargs = _cast((args, kwargs), torch.float32 if wide else low)
            elif how == "banned":
                raise RuntimeError(f"{op.name()} is unsafe to autocast: CUDA autocast raises here")
            return op(*args, **kwargs)

    return kernel


_NO_LOW_KERNEL = re.compile(r"not implemented for '(Half|BFloat16)'")


class _EmulateLowKernels(TorchDispatchMode):
    """Ops without a CPU kernel for the low dtype run in fp32, their outputs rounded to the dtype they would
    have had; each such op is noted once. The ops of rules/policy/kernels.toml's ``simulated_in_fp32`` run so
    too, on inputs of its dtypes and without a note: that is the CUDA kernel's own arithmetic, where this
    CPU's half kernel is a slow reference one (fp16 convolution_backward); ``in_fp32`` counts them per op."""

    def __init__(self, notes: list[str], in_fp32: dict[str, int]):
        super().__init__()
        self.notes = notes
        self.in_fp32 = in_fp32

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _cuda_arithmetic(func, args, kwargs):
            name = func.overloadpacket.__name__
            self.in_fp32[name] = self.in_fp32.get(name, 0) + 1
            # Without data (an export's fake tensors, meta) only the output's dtype, shape and strides exist, and
            # the op's own kernel gives those: the fp32 copies and the meta run of _in_fp32 would change nothing
            # (0.2 of cpubone_nano's 1.0-1.2 CPU s check, its 33 convolutions).
            if _without_data((args, kwargs)):
                return func(*args, **kwargs)
            steps = _CUDA_STEPS.get(name)
            return steps[1](*args, **kwargs) if steps else _in_fp32(func, args, kwargs)
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            low = next((t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                        and is_half(t.dtype)), None)
            missing, gap = _NO_LOW_KERNEL.search(str(exc)), kernel_gap(exc, low)
            if gap is None or (missing is None and low is None):
                raise
        # "Half" as torch words it; oneDNN names no dtype (nn.LSTM's mkldnn_rnn_layer): the inputs' is meant.
        lacks = (f"CPU has no {missing.group(1)} kernel" if missing
                 else f"this CPU's {gap.library} has no {gap.dtype} kernel")
        low = next((t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and is_half(t.dtype)),
                   torch.float32)
        out = _in_fp32(func, args, kwargs)
        message = (f"CUDA simulation: {lacks} for {func.overloadpacket}; it ran in float32, rounded to "
                   f"{name_of(low)}")
        if message not in self.notes:
            self.notes.append(message)
        note(message)
        return out


# kernels.toml ``simulated_in_fp32`` ops whose CUDA kernel rounds intermediates to half as well (the attention
# backward's probabilities): (whether this call is one it computes, the computation); the others: _in_fp32.
_CUDA_STEPS: dict[str, tuple[Callable, Callable]] = {
    "_scaled_dot_product_flash_attention_for_cpu_backward": (cuda_attention.applies, cuda_attention.flash_backward),
}


def _without_data(tree: Any) -> bool:
    """Whether the tensors in ``tree`` hold no values: fake tensors (a trace's) or meta tensors."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t)) for t in tree_leaves(tree))


def _cuda_arithmetic(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is one of kernels.toml's ``simulated_in_fp32`` ops and every floating tensor it is given
    has one of its dtypes (mixed dtypes go to the real kernel, which refuses them as CUDA's does); an op of
    ``_CUDA_STEPS`` says itself which calls it computes."""
    name = func.overloadpacket.__name__
    dtypes = kernels()["simulated_in_fp32"].get(name)
    if not dtypes:
        return False
    if name in _CUDA_STEPS:
        return _CUDA_STEPS[name][0](args, kwargs, dtypes)
    floating = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floating) and all(name_of(d) in dtypes for d in floating)


def _in_fp32(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``func`` run on fp32 copies of its half inputs, each output rounded to the dtype it would have had; what
    an in-place or out= op wrote into a copy is written back into the caller's tensor."""
    want = _output_dtypes(func, args, kwargs)
    originals: dict[int, torch.Tensor] = {}

    def up(t):
        if isinstance(t, torch.Tensor) and is_half(t.dtype):
            u = t.float()
            originals[id(u)] = t
            return u
        return t

    up_args, up_kwargs = tree_map(up, (args, kwargs))
    out = func(*up_args, **up_kwargs)
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = up_args[i] if i < len(up_args) and not a.kwarg_only else up_kwargs.get(a.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and id(t) in originals:
                originals[id(t)].copy_(t)
    flat, spec = tree_flatten(out)
    low = next((t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and is_half(t.dtype)),
               torch.float32)
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor):
            continue
        if id(t) in originals:
            flat[i] = originals[id(t)]
        elif want and want[i] is not None and want[i] != t.dtype:
            flat[i] = t.to(want[i])            # float16, or complex32 (polar)
        elif not want and t.dtype == torch.float32 and is_half(low):
            flat[i] = t.to(low)
    return tree_unflatten(flat, spec)


def _output_dtypes(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list | None:
    """The dtype of each (flattened) output ``func`` gives these inputs, from its meta kernel (None: no meta
    kernel; the low dtype is then assumed for fp32 outputs)."""
    try:
        meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return [getattr(t, "dtype", None) for t in tree_flatten(func(*meta[0], **meta[1]))[0]]
    except Exception:
        return None


class PolicyUpcast:
    """While entered (inside ``torch.autocast("cpu", dtype=policy.low)``), CPU autocast follows ``policy``'s
    device instead of CPU's; see the module docstring. ``notes`` lists what was approximated; ``in_fp32`` counts,
    per aten op, the calls computed in fp32 as CUDA's kernel computes them (``{"convolution_backward": 12}``).

    ``PolicyUpcast.entered`` counts the simulated regions this process entered (tests read it to check that a
    stage ran under the simulation); ``PolicyUpcast.active`` is the one entered now, if any."""

    entered: ClassVar[int] = 0
    active: ClassVar["PolicyUpcast | None"] = None

    def __init__(self, policy: Policy):
        self.policy = policy
        self.notes: list[str] = []
        self.in_fp32: dict[str, int] = {}
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "PolicyUpcast":
        PolicyUpcast.entered += 1
        if PolicyUpcast.active is not None:
            # Nested (a stage run inside another's simulation): the kernels are registered already.
            if PolicyUpcast.active.policy != self.policy:
                raise RuntimeError("a simulation of another policy is active")
            self.notes, self.in_fp32 = PolicyUpcast.active.notes, PolicyUpcast.active.in_fp32
            return self
        with contextlib.ExitStack() as stack:
            stack.enter_context(quiet())    # torch warns (once) that a kernel is overridden, and more inside
            lib = torch.library.Library("aten", "IMPL")
            stack.callback(lib._destroy)    # the overridden CPU kernels come back
            for op, how in overrides(self.policy.device, self.policy.dtype_name).items():
                # No category: as if AutocastCPU had no kernel for the op. A fallthrough, not a kernel that runs
                # it below autocast: a composite (conv2d.padding) must still meet autocast in the ops it calls.
                kernel = torch.library.fallthrough_kernel if how is None else _kernel(_overload(op), how)
                lib.impl(op.split("::", 1)[1], kernel, _KEY)
            stack.enter_context(_EmulateLowKernels(self.notes, self.in_fp32))
            self._stack = stack.pop_all()
        PolicyUpcast.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            PolicyUpcast.active = None
            stack.close()


def simulation(policy: Policy) -> contextlib.AbstractContextManager:
    """What to run a CPU-autocast forward inside so its numerics follow ``policy`` (a no-op for a CPU target)."""
    if policy.device == "cpu":
        return contextlib.nullcontext()
    return PolicyUpcast(policy)


def simulated(policy: Policy, device: str) -> bool:
    """Whether a forward on ``device`` tensors runs ``policy``'s target through the simulation (a CUDA target's
    forward on CPU tensors), rather than through ``device``'s own autocast."""
    return device == "cpu" and policy.device != "cpu"


@contextlib.contextmanager
def target_autocast(policy: Policy, device: str = "cpu", *, enter_autocast: bool = True,
                    **autocast_kw: Any) -> Iterator[PolicyUpcast | None]:
    """The one way ampaudit runs a forward "under the target": autocast to ``policy.low`` as ``policy``'s device
    applies it, for a forward whose tensors are on ``device``::

        with target_autocast(Policy.load("cuda", "float16"), "cpu") as sim:
            out = model(x)     # CPU autocast, with CUDA's policy simulated; sim.notes: what was approximated

    On the target's own device (or any device but a CPU running a CUDA target) this is that device's
    ``torch.autocast`` and yields None; on ``"meta"`` (no kernels, autocast never applies) nothing at all.
    ``autocast_kw`` go to ``torch.autocast`` (``cache_enabled``). ``enter_autocast=False`` is for callers that
    enter ``torch.autocast(device, dtype=policy.low)`` themselves, around the forward only (the runtime's
    measurements, which also run in training): it applies only the simulation, if any. Capture, the
    propagation probes, calibration and the verification of graph and source fixes all run through here."""
    if device == "meta":
        yield None
        return
    amp = torch.autocast(device, dtype=policy.low, **autocast_kw) if enter_autocast else contextlib.nullcontext()
    with amp:
        if not simulated(policy, device):
            yield None
            return
        with PolicyUpcast(policy) as sim:
            yield sim
