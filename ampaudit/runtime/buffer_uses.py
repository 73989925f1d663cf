"""Buffers that hold values a low dtype cannot, and whether casting the model to it changes anything.

    found = overflowing_buffers(model, torch.float16, args, kwargs)   # [{"module", "buffer", "absmax"}], for AMP501

A buffer above the dtype's largest finite number becomes inf when the model is cast (``model.half()``). That loses
nothing when the buffer is only ever the bound of a clamp (gemma3n's ``gradient_clipping`` of 1e10 in
``torch.clamp(x, -g, g)``), or an operand of ``minimum``/``maximum``: a low-dtype value never exceeds the dtype's
max, so a bound of inf clamps it exactly as the bound of 1e10 does. Such buffers are left out, with a note. Which
ops a buffer reaches is recorded at dispatch level over one FP32 forward (only when some buffer is that large),
following it through the ops that only move or negate it (``-g``, ``g.to(x)``, views). A buffer that forward never
reads (gemma3n's audio tower on text inputs) is judged by its module's ``forward`` source instead: excused when
every ``self.<name>`` there is, bare or negated, a bound of ``torch.clamp``/``clip``/``minimum``/``maximum`` or of
the ``.clamp`` method.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ampaudit.dtypes import limits, name_of
from ampaudit.runtime.replay_state import capture_rng, float_tensors, preserved

# Ops whose output is the buffer again, moved, viewed or negated: a use of the output is a use of the buffer.
_CARRY = {"neg", "abs", "clone", "detach", "alias", "_to_copy", "to", "view", "expand", "reshape", "unsqueeze",
          "squeeze", "t", "lift_fresh", "lift_fresh_copy", "_unsafe_view", "contiguous"}
# Ops with an argument where inf bounds a low-dtype value as any number beyond the dtype's max does: argument
# positions that are bounds (None: any of the operands).
_BOUNDS: dict[str, tuple[int, ...] | None] = {"clamp": (1, 2), "clip": (1, 2), "clamp_min": (1,), "clamp_max": (1,),
                                              "clamp_": (1, 2), "clamp_min_": (1,), "clamp_max_": (1,),
                                              "minimum": None, "maximum": None, "fmin": None, "fmax": None}


class _BufferUses(TorchDispatchMode):
    """Records, for each watched tensor (and what carries it), whether some op uses it other than as a bound."""

    def __init__(self, watched: dict[str, torch.Tensor]):
        super().__init__()
        self.origin: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        for name, t in watched.items():
            self.origin[t] = name
        self.other_use: set[str] = set()
        self.bound_use: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket.__name__
        positional = list(args) + [kwargs[k] for k in ("min", "max", "other") if k in kwargs]
        used = [(i, self.origin[a]) for i, a in enumerate(positional)
                if isinstance(a, torch.Tensor) and a in self.origin]
        if not used:
            return out
        if op in _CARRY:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.origin[t] = used[0][1]
            return out
        bounds = _BOUNDS.get(op, ())
        for i, name in used:
            (self.bound_use if bounds is None or i in bounds else self.other_use).add(name)
        return out


# torch.clamp(x, lo, hi): the positions of the bounds; the method x.clamp(lo, hi) counts from one less.
_SOURCE_BOUNDS = {"clamp": (1, 2), "clip": (1, 2), "clamp_min": (1,), "clamp_max": (1,)}
_EITHER = {"minimum", "maximum", "fmin", "fmax"}


def _bound_in_source(mod: nn.Module, attr: str) -> bool:
    """True when ``type(mod).forward`` reads ``self.<attr>`` and every read is a clamp/min/max bound."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(mod).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == attr
             and isinstance(n.value, ast.Name) and n.value.id == "self"]
    return bool(reads) and all(_is_bound(n, parents) for n in reads)


def _is_bound(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` (``self.<attr>``), bare or negated, is a bound argument of the call around it."""
    arg = node
    while isinstance(parents.get(arg), ast.UnaryOp) and isinstance(parents[arg].op, (ast.USub, ast.UAdd)):
        arg = parents[arg]
    call = parents.get(arg)
    if isinstance(call, ast.keyword):
        return call.arg in ("min", "max") and _bound_name(parents.get(call)) in _SOURCE_BOUNDS
    if not isinstance(call, ast.Call) or arg not in call.args:
        return False
    name = _bound_name(call)
    if name in _EITHER:
        return True
    if name not in _SOURCE_BOUNDS:
        return False
    function = isinstance(call.func, ast.Name) or (isinstance(call.func.value, ast.Name)
                                                     and call.func.value.id == "torch")
    return call.args.index(arg) + (0 if function else 1) in _SOURCE_BOUNDS[name]


def _bound_name(call: ast.AST | None) -> str | None:
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _bound_only(model: nn.Module, args: tuple, kwargs: dict,
                watched: dict[str, torch.Tensor]) -> tuple[set[str], set[str]]:
    """(the names in ``watched`` one FP32 forward of ``model`` uses only as clamp/min/max bounds, those it reads)."""
    mode = _BufferUses(watched)
    try:
        with preserved(model, capture_rng(float_tensors((args, kwargs)))), torch.no_grad(), mode:
            model(*args, **kwargs)
    except Exception:
        return set(), set(watched)  # not judged: the buffers are reported as before
    return mode.bound_use - mode.other_use, mode.bound_use | mode.other_use


def overflowing_buffers(model: nn.Module, low: torch.dtype, args: tuple | None = None,
                        kwargs: dict | None = None) -> list[dict]:
    """The floating buffers of ``model`` whose largest finite magnitude exceeds the max of ``low``, less those a
    forward on ``args``/``kwargs`` uses only as clamp bounds (a note names them)."""
    from ampaudit.notes import note

    limit = limits(low).max
    found: dict[str, dict] = {}
    watched: dict[str, torch.Tensor] = {}
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and not buf.is_meta and buf.numel():
            # Largest finite magnitude: an inf or NaN already in FP32 (clamp bounds of +-inf that mean "no
            # clamp", as gemma4_vit's input_min/input_max) is the same value in the low dtype; nothing is lost.
            finite = buf.detach()[torch.isfinite(buf.detach())]
            value = float(finite.abs().max()) if finite.numel() else 0.0
            if value > limit:
                found[name] = {"module": name.rpartition(".")[0], "buffer": name, "absmax": value}
                watched[name] = buf
    if watched and args is not None:
        excused, read = _bound_only(model, tuple(args), dict(kwargs or {}), watched)
        modules = dict(model.named_modules())
        for name in set(watched) - read:
            owner, _, attr = name.rpartition(".")
            if owner in modules and _bound_in_source(modules[owner], attr):
                excused.add(name)
        if excused:
            names = [n for n in found if n in excused]      # model order
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            dtype = name_of(low)
            note(f"buffer {names[0]}{more} holds values beyond {dtype}'s max but only bounds a clamp, min or max: "
                 f"cast to {dtype} it becomes inf, which bounds {dtype} values the same way (not reported)")
            for name in excused:
                del found[name]
    return list(found.values())
