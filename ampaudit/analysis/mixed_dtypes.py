"""What an op's kernel does when its floating inputs arrive in more than one dtype, as only autocast lets them.

Autocast casts the inputs of the ops on its lists (lowered, fp32 and promote ops get one dtype); every other op
receives its inputs as the model produced them, and many kernels (dot, index_put, scatter_add, index_add, lerp,
sdpa, ...) require one dtype. Two questions, both answered by the fake kernels themselves, so no op list can drift:

    run_promoted(interp, node)          # the fp32 run met mixed dtypes the model produces itself (x.half() @ ...):
                                        # rerun with them promoted, as CUDA's promote ops do; None if that fails too
    raises_at_autocast_dtypes(interp, node, inputs)
                                        # the error the op's kernel raises on the dtypes autocast gives it, or None

``interp`` is the running :class:`~ampaudit.analysis.amp_prop.AmpProp` (its env holds fake tensors; its
``amp_dtype`` the autocast dtype of each node).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses import fake_tensor
from torch.utils._pytree import tree_flatten, tree_map

from ampaudit.capture.opaque import plain, user_function
from ampaudit.machine.kernels import kernel_gap

# What a fake or meta kernel raises when it cannot know an op's output (no kernel, data-dependent shapes or values):
# the shapes after it are unknown, but the inputs may well fit.
NO_KERNEL = (NotImplementedError, fake_tensor.DynamicOutputShapeException, fake_tensor.DataDependentOutputException,
             fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException)

# Past this many elements (inputs and the module's weights) an op is not rerun for real to confirm an error; a
# mixed-dtype op that its fake kernel let through, past the smaller one.
_CONFIRM_NUMEL = 1 << 27
_CHECK_NUMEL = 1 << 22
_UNCONFIRMED = object()
# Categories whose inputs autocast casts to one dtype before the kernel runs.
CASTING = frozenset({"lower", "fp32", "fp32_output", "promote"})


def _floats(values) -> set[torch.dtype]:
    return {v.dtype for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}


def _call(interp, n: fx.Node, args, kwargs) -> Any:
    return getattr(interp, n.op)(n.target, args, kwargs)


def run_promoted(interp, n: fx.Node) -> Any:
    """``n``'s fake output with its floating tensor inputs promoted to their widest dtype, or None."""
    if n.op not in ("call_function", "call_method", "call_module"):
        return None
    args, kwargs = interp.fetch_args_kwargs_from_env(n)
    dtypes = _floats((args, kwargs))
    if len(dtypes) < 2:
        return None
    wide = dtypes.pop()
    for d in dtypes:
        wide = torch.promote_types(wide, d)

    def cast(v):
        return v.to(wide) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v

    try:
        return _call(interp, n, *tree_map(cast, (args, kwargs)))
    except Exception:
        return None


def raises_at_autocast_dtypes(interp, n: fx.Node, category: str | None) -> tuple[str, list[torch.dtype]] | None:
    """(the kernel's error, the floating dtypes it met) when ``n`` raises on its autocast input dtypes, else None."""
    if category in CASTING or n.op not in ("call_function", "call_method", "call_module"):
        return None
    env = interp.env
    inputs = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)]
    if any(a not in env for a in inputs):
        return None
    dtypes = {d for a in inputs if isinstance(env[a], torch.Tensor) and env[a].dtype.is_floating_point
              for d in [interp.amp_dtype.get(a)] if isinstance(d, torch.dtype) and d.is_floating_point}
    if n.op == "call_module":
        dtypes |= {p.dtype for p in interp.module.get_submodule(n.target).parameters(recurse=False)
                   if p.dtype.is_floating_point}
    if len(dtypes) < 2:
        return None

    def as_amp(a: fx.Node):
        v, d = env[a], interp.amp_dtype.get(a)
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and isinstance(d, torch.dtype) \
                and d.is_floating_point and d != v.dtype:
            return v.to(d)
        return v

    args, kwargs = fx.node.map_arg(n.args, as_amp), fx.node.map_arg(n.kwargs, as_amp)
    memo, key = getattr(interp, "probe_memo", None), _signature(n, args, kwargs)
    if memo is None or key is None:
        return _probe(interp, n, args, kwargs, dtypes)
    if key not in memo:
        memo[key] = _probe(interp, n, args, kwargs, dtypes)
    found = memo[key]
    return None if found is None else (found[0], list(found[1]))


def _signature(n: fx.Node, args, kwargs) -> tuple | None:
    """What a torch op's verdict depends on: the op, and its inputs' shapes, strides and dtypes (or values);
    None for modules and the user's functions, whose verdict may hang on more. Blocks repeat the same op on the
    same shapes (ResNet's stages, a detection head per level): each is probed once."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    parts = []
    for v in tree_flatten((args, kwargs))[0]:
        if isinstance(v, torch.Tensor):
            parts.append((tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type))
        elif isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                            torch.memory_format)):
            parts.append((type(v).__name__, v))
        else:
            return None
    return (n.target, tree_flatten((args, kwargs))[1], tuple(parts))


def _probe(interp, n: fx.Node, args, kwargs, dtypes: set) -> tuple[str, list[torch.dtype]] | None:
    if _error(interp, n, args, kwargs) is None:
        return None
    # Confirmed under the target's autocast: a composite op is cast in the ops it decomposes into (einsum's
    # bmm is lowered, so einsum takes mixed dtypes), which the kernel alone does not show.
    from ampaudit.simulate import target_autocast

    # On CPU zeros (meta tensors never meet autocast); too large to confirm is not reported.
    with target_autocast(interp.policy, "cpu"):
        exc = real_error(interp, n, args, kwargs, max_numel=_CHECK_NUMEL, too_big=_UNCONFIRMED)
    if exc is None or exc is _UNCONFIRMED or kernel_gap(exc, interp.policy.low) is not None:
        return None     # (a kernel this CPU lacks for the dtype says nothing about mixed dtypes on the target)
    # The kernel's own words name the dtypes it expected.
    return " ".join(str(exc).split())[:200], sorted(dtypes, key=lambda d: (d.itemsize, str(d)))


def probeable(interp, n: fx.Node) -> bool:
    """Whether a probe may run ``n`` for real: torch's ops and modules, never the user's own code (a wrapped
    function or a user module kept as a leaf, whose Python may do anything on zeros)."""
    if n.op == "call_function":
        return not user_function(n.target)
    if n.op == "call_module":
        return type(interp.module.get_submodule(n.target)).__module__.startswith("torch.")
    return True


def _error(interp, n: fx.Node, args, kwargs) -> Exception | None:
    """What ``n`` raises on these inputs: its fake kernel, then (meta kernels do not all check dtypes; cross's
    does not) its real kernel on zeros; None when neither raises or no kernel can tell."""
    try:
        _call(interp, n, args, kwargs)
        return real_error(interp, n, args, kwargs, max_numel=_CHECK_NUMEL)
    except NO_KERNEL:
        return None
    except Exception as raised:
        return raised


def real_error(interp, n: fx.Node, args, kwargs, max_numel: int = _CONFIRM_NUMEL, too_big: Any = None) -> Any:
    """What ``n``'s real kernel raises on zeros of ``args``' shapes and dtypes (fake or meta), or None.

    ``too_big`` when the inputs and the module's weights hold more than ``max_numel`` elements; None too when the
    node is not an op (a higher-order operator, a placeholder).
    """
    if n.op not in ("call_module", "call_function", "call_method") or \
            isinstance(n.target, torch._ops.HigherOrderOperator) or not probeable(interp, n):
        return None
    with fake_tensor.unset_fake_temporarily():
        module = interp.module.get_submodule(n.target) if n.op == "call_module" else None
        numel = sum(t.numel() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        numel += sum(p.numel() for p in module.parameters()) if module is not None else 0
        if numel > max_numel:
            return too_big

        def real(v):
            if not isinstance(v, torch.Tensor):
                return v
            return torch.zeros(v.shape, dtype=v.dtype, device="cpu" if v.device.type == "meta" else v.device)

        args, kwargs = tree_map(real, plain((args, kwargs)))
        try:
            if module is not None:
                # A copy: a BatchNorm in training mode would update the user's running statistics.
                module = copy.deepcopy(module)
                if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
                    module = module.to_empty(device="cpu")
                module(*args, **kwargs)
            elif n.op == "call_function":
                n.target(*args, **kwargs)
            else:
                getattr(args[0], n.target)(*args[1:], **kwargs)
        except Exception as exc:
            return exc
    return None
