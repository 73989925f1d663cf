"""The FP32 shadow's submodule calls, kept so a composite's own re-run need not compute them again.

    calls = ShadowCalls(names)              # holds at most settings.toml's [calibration] shadow_calls_mib
    handles = calls.hook()                  # during the FP32 shadow forward: a frame per module call
    ...                                     # in the composite's post hook, before its re-run:
    with calls.serving(composite, own):     # its children return their shadow outputs where nothing differs
        composite(*rounded_args)
    # the composite's frame (its children's calls) is freed when it returns

A composite's own re-run (:mod:`ampaudit.runtime.own_rerun`) computes each submodule it calls in FP32. Many of
those calls are the shadow's own calls again, bit for bit: a child fed the composite's input untouched, or the
previous child's output handed on (``ChildrenInFP32`` gives it back as its FP32 value), in a container every child.
Computing them again made the comparison with FP32 cost one FP32 forward per nesting level. Such a child's answer
is the one the shadow computed, on the same inputs, weights and RNG state, so it is returned from here instead,
cloned (the composite may write into it). A call is served only when all of this holds, else it runs:

- its inputs are equal to the shadow's, tensor by tensor (``torch.equal``, same dtype and shape; NaN never
  matches), and every other argument an equal value of an immutable type (None, bool, numbers, str, bytes, tuples
  and frozensets of those, torch.dtype/device/Size, enums), compared with the arguments as they were at the
  shadow's call (flattened then: a dict or list changed since shows). Any other object (a cache, a config) may
  have changed inside though it is the same object, so such a call is computed, not served;
- neither those inputs nor its outputs were written in place since the shadow's call (version counters), and
  its own forward did not write into its inputs (their versions before the call: positional ones from the global
  pre-hook, keyword ones from :meth:`ShadowCalls.note_kwargs`; a call whose tensors were not all seen is not kept);
- the CPU RNG state is the one the shadow's call started from; it is then set to where that call left it;
- every tensor is on the CPU (a GPU's RNG state is not compared here), and it is the outermost submodule of the
  re-run (the one ``ChildrenInFP32`` turned to FP32) and called as a module.

Calls are kept per frame of the shadow's call stack and dropped when their parent returns, so what is held is
the completed siblings along the current stack; past ``cap_bytes`` of tensors held, new calls are not kept (they
run again, as before).
"""
from __future__ import annotations

import contextlib
import enum
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ampaudit.policy import settings

# Values that cannot change while the object stays the same (tuples and frozensets: when their items cannot).
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
              torch.layout, torch.memory_format, enum.Enum)


class _Call:
    __slots__ = ("mod", "rng", "versions", "flat", "spec", "out", "out_versions", "rng_after", "calls", "nbytes")

    def __init__(self, mod: nn.Module, rng: torch.Tensor, versions: dict[int, int]):
        self.mod, self.rng, self.versions = mod, rng, versions
        self.flat: list | None = None         # its arguments flattened at the call (containers may change later)
        self.spec = self.out = self.rng_after = None   # out: its output flattened at the call (leaves, spec)
        self.out_versions: list[int] = []
        self.calls: list[_Call] = []          # its completed submodule calls, in order
        self.nbytes = 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a is b or (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b))
    return type(a) is type(b) and _immutable(a) and (a is b or a == b)


def _immutable(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)) and not isinstance(value, torch.Size):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


class ShadowCalls:
    """The shadow's module calls (see the module docstring); ``served`` counts the calls returned from here."""

    def __init__(self, names: dict[nn.Module, str], *, cap_bytes: int | None = None):
        # Default: rules/policy/settings.toml [calibration] shadow_calls_mib.
        self.names = names
        self.cap_bytes = (int(settings()["calibration"]["shadow_calls_mib"]) << 20) if cap_bytes is None else cap_bytes
        self.paused = False
        self.held = 0
        self.served = 0
        self._stack: list[_Call] = [_Call(nn.Module(), torch.empty(0), {})]   # a root frame for the top call
        self._serving: tuple[nn.Module, Any, dict[nn.Module, list[_Call]]] | None = None
        self._inside = 0

    def hook(self) -> list[Any]:
        """Global hooks that keep the calls while not ``paused``; the caller removes the handles."""
        return [register_module_forward_pre_hook(self._pre),
                register_module_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, mod: nn.Module, args: tuple) -> None:
        if self.paused or mod not in self.names:
            return
        self._stack.append(_Call(mod, torch.get_rng_state(), {id(t): t._version for t in _tensors(args)}))

    def note_kwargs(self, mod: nn.Module, kwargs: dict) -> None:
        """From a pre-hook with kwargs on ``mod`` (after the global one): the versions of its keyword tensors."""
        if not self.paused and len(self._stack) > 1 and self._stack[-1].mod is mod:
            self._stack[-1].versions.update((id(t), t._version) for t in _tensors(kwargs))

    def _post(self, mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self.paused or mod not in self.names or len(self._stack) < 2 or self._stack[-1].mod is not mod:
            return
        call = self._stack.pop()
        flat, spec = tree_flatten((args, kwargs))
        ins, outs = [t for t in flat if isinstance(t, torch.Tensor)], _tensors(out)
        keep = (all(call.versions.get(id(t)) == t._version for t in ins) and
                all(t.device.type == "cpu" for t in ins + outs))
        size = sum(t.numel() * t.element_size() for t in {id(t): t for t in ins + outs}.values())
        if keep and self.held + size <= self.cap_bytes:
            # Its output flattened now: the caller may rebind a field of the container it returned later
            # (transformers' get_text_features sets `outputs.pooler_output = projection(...)`), and a served
            # container read then would hand back that caller's value as the child's.
            call.flat, call.spec, call.out = flat, spec, tree_flatten(out)
            call.versions = {id(t): t._version for t in ins}
            call.out_versions = [t._version for t in outs]
            call.rng_after = torch.get_rng_state()
            call.nbytes = size
            self.held += size
            self._stack[-1].calls.append(call)
        # Its own children's calls are the composite's re-run's (done by now, in the probe's hook that ran
        # before this one) and no caller's: freed here.
        self._free(call.calls)
        call.calls = []

    def _free(self, calls: list[_Call]) -> None:
        for c in calls:
            self.held -= c.nbytes
            c.flat = c.spec = c.out = None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """While active (a leaf's own re-run), calls are not kept: they are the re-run's, not the shadow's."""
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was

    @contextlib.contextmanager
    def serving(self, composite: nn.Module, own: Any) -> Iterator[None]:
        """While active (the re-run of ``composite``, the innermost module whose shadow call is running), its
        submodules' calls are returned from the shadow where they match; ``own`` is the re-run's
        :class:`~ampaudit.runtime.own_rerun.ChildrenInFP32` (its ``outermost()`` names the child in FP32)."""
        frame = self._stack[-1] if self._stack[-1].mod is composite else None
        queues: dict[nn.Module, list[_Call]] = {}
        for c in frame.calls if frame is not None else []:
            queues.setdefault(c.mod, []).append(c)
        patched = []
        for mod in queues:
            if "forward" in mod.__dict__:
                continue                      # an instance forward already (a wrapper's): left alone
            try:
                mod.forward = self._forward(mod, type(mod).forward.__get__(mod))
            except (AttributeError, TypeError, RuntimeError):
                continue
            patched.append(mod)
        paused, self._serving, self.paused = self.paused, (composite, own, queues), True
        try:
            yield
        finally:
            self._serving, self.paused = None, paused
            for mod in patched:
                mod.__dict__.pop("forward", None)

    def _forward(self, mod: nn.Module, real: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            serving = self._serving
            if serving is None or self._inside or serving[1].outermost() is not mod:
                return real(*args, **kwargs)
            queue = serving[2].get(mod)
            call = queue.pop(0) if queue else None
            try:
                hit = call is not None and self._matches(call, args, kwargs)
            except Exception:  # noqa: BLE001 - a tensor subclass without torch.equal: computed, not served
                hit = False
            if hit:
                torch.set_rng_state(call.rng_after)
                self.served += 1
                leaves, out_spec = call.out
                return tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves],
                                      out_spec)
            self._inside += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._inside -= 1
        return forward

    def _matches(self, call: _Call, args: tuple, kwargs: dict) -> bool:
        if call.out is None:
            return False
        mine, spec = tree_flatten((args, kwargs))
        theirs = call.flat
        if spec != call.spec or len(mine) != len(theirs):
            return False
        if any(isinstance(t, torch.Tensor) and t._version != call.versions.get(id(t)) for t in theirs):
            return False
        if [t._version for t in call.out[0] if isinstance(t, torch.Tensor)] != call.out_versions:
            return False
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in mine):
            return False
        if not torch.equal(torch.get_rng_state(), call.rng):
            return False
        return all(_same(a, b) for a, b in zip(mine, theirs))
