"""Running a model again without side effects: its floating tensors, its buffers, its RNG, its device.

    with preserved(model, capture_rng(float_tensors(x))):   # buffers (BatchNorm stats) and RNG restored
        model(x)
    restore = buffer_snapshot(model); ...; restore()
    restore = state_snapshot(model); ...; restore()            # parameters too, modes, requires_grad, RNG
    with kept(original, fixed):                             # the same, around a block, for several models
    with rng_kept():                                        # only the global RNGs (torch, CUDA, random, NumPy)
    state = global_rng_state(); ...; set_global_rng_state(state)   # the same, as data a checkpoint can store
    model_device(model)                                     # "cpu": where its parameters live

Every replay of ampaudit (the non-finite locator, the divergence probe, decisions, calibration, fix
verification) leaves the model and the RNG as it found them through these.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten


def float_tensors(tree: Any) -> list[torch.Tensor]:
    """The floating tensors of ``tree`` (tuples, lists, dicts, and dataclass outputs, which pytree leaves whole).

    fp8 tensors are left out: they hold the scaled operands of an fp8 GEMM (torchao's Float8Linear), saturated by
    their cast and without isfinite kernels; the GEMM's own output is what is checked."""
    out = []
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            if t.is_floating_point() and t.dtype.itemsize > 1:
                out.append(t)
        elif dataclasses.is_dataclass(t) and not isinstance(t, type):
            out += float_tensors([getattr(t, f.name) for f in dataclasses.fields(t)])
    return out


def buffer_snapshot(root: nn.Module) -> Callable[[], None]:
    """A copy of ``root``'s buffers (BatchNorm running stats); call the result to put them back."""
    saved = {name: lazy_copy(b.detach()) for name, b in root.named_buffers()}

    def restore() -> None:
        with torch.no_grad():
            for name, b in root.named_buffers():
                if name in saved and b.shape == saved[name].shape and not _untouched(b, saved[name]):
                    b.copy_(saved[name])
    return restore


def state_snapshot(*roots: nn.Module) -> Callable[[], None]:
    """A copy of everything ``roots`` hold: each parameter and buffer (values and the tensor object under its
    name), each parameter's ``requires_grad`` and ``.grad`` object, each module's training mode, and the global
    RNGs (:func:`rng_snapshot`). Call the result to put it all back, bit for bit (as often as needed).

    Only tensors whose bits changed are written back, so a tensor user code did not touch keeps its version
    counter (autograd graphs the caller holds stay valid). The version counter cannot tell which ones changed by
    itself: ``p.data.mul_(m)``, the usual EMA update, writes through a tensor with a counter of its own. Meta
    tensors hold no values and are only put back under their names. The copies are copy-on-write
    (:func:`lazy_copy`): a snapshot of a model nothing writes copies no memory, where an eager copy of every
    weight took seconds on a large model."""
    slots = []
    modules = [mod for root in roots for mod in root.modules()]
    for mod in modules:
        for table in (mod._parameters, mod._buffers):
            for key, t in table.items():
                if t is not None:
                    value = None if t.is_meta else lazy_copy(t.detach())
                    slots.append((table, key, t, value, t.requires_grad, t.grad if t.is_leaf else None))
    modes = [(mod, mod.training) for mod in modules]
    restore_rng = rng_snapshot()

    def restore() -> None:
        with torch.no_grad():
            for table, key, t, value, requires_grad, grad in slots:
                table[key] = t
                if value is not None and t.shape == value.shape and not _untouched(t, value) \
                        and not _same_bits(t, value):
                    t.copy_(value)
                if t.is_leaf:
                    if t.requires_grad != requires_grad:
                        t.requires_grad_(requires_grad)
                    if t.grad is not grad:
                        t.grad = grad
        for mod, training in modes:
            mod.training = training
        restore_rng()
    return restore


@contextlib.contextmanager
def kept(*roots: nn.Module) -> Iterator[None]:
    """Inside, anything may run ``roots``' forwards (in training mode, writing their state, drawing dropout
    masks); outside, ``roots`` and the global RNGs are as before (:func:`state_snapshot`)."""
    restore = state_snapshot(*roots)
    try:
        yield
    finally:
        restore()


def global_rng_state() -> dict[str, Any]:
    """The global RNG states a forward, a loss or a data loader may draw from, as tensors and plain data (what a
    checkpoint stores: it loads with ``torch.load(weights_only=True)``): torch's CPU generator (``torch``), each
    CUDA device's once CUDA is initialised (``cuda``), Python's ``random`` (``python``) and, once something
    imported it, NumPy's (``numpy``). :func:`set_global_rng_state` puts them back. (ampaudit draws only from
    torch's; the user's code run by a command may draw from any.)"""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")     # torch imports it where it is installed
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Put back the global RNG states :func:`global_rng_state` returned (in this process or a checkpoint's)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def rng_snapshot() -> Callable[[], None]:
    """The global RNG states as they are now (:func:`global_rng_state`); call the result to put them back (as
    often as needed)."""
    return functools.partial(set_global_rng_state, global_rng_state())


def rng_kept() -> contextlib.AbstractContextManager[None]:
    """The global RNGs as they were on exit (:func:`rng_snapshot`): :func:`kept` of no model. Also a decorator
    (``@rng_kept()``) for a command that builds a model or draws inputs from its own file."""
    return kept()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def lazy_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that costs nothing until one of them is written: a copy-on-write clone (the first write to
    either, through any alias, even ``.data`` or NumPy, copies the memory then; views and aliases of ``t`` stay
    one storage). An eager clone where the tensor type has no such clone (subclasses)."""
    lazy = getattr(torch, "_lazy_clone", None)
    if lazy is not None and type(t) is torch.Tensor:
        try:
            return lazy(t)
        except (RuntimeError, NotImplementedError):
            pass
    return t.clone()


def _untouched(t: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``t`` still reads the memory its :func:`lazy_copy` ``copy`` reads: nothing wrote it since."""
    try:
        return t.const_data_ptr() == copy.const_data_ptr() and t.stride() == copy.stride()
    except (RuntimeError, AttributeError):
        return False


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaN equal to the same NaN, -0.0 not equal to 0.0)."""
    if a.dtype != b.dtype or a.device != b.device:
        return False
    as_int = _SAME_SIZE_INT.get(a.dtype.itemsize) if a.is_floating_point() else None
    if as_int is not None and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


@contextlib.contextmanager
def rng_replayed(rng_state: dict | None) -> Iterator[None]:
    """Inside: the RNG state ``rng_state`` (see :func:`capture_rng`); outside, the state is as before."""
    cuda_devices = list(rng_state.get("cuda", {})) if rng_state else []
    with torch.random.fork_rng(devices=cuda_devices, enabled=True):
        if rng_state:
            torch.set_rng_state(rng_state["cpu"])
            for dev, state in rng_state.get("cuda", {}).items():
                torch.cuda.set_rng_state(state, dev)
        yield


@contextlib.contextmanager
def preserved(root: nn.Module, rng_state: dict | None) -> Iterator[None]:
    """Run a replay without side effects: buffers (BatchNorm running stats) and RNG are restored."""
    restore = buffer_snapshot(root)
    with rng_replayed(rng_state):
        try:
            yield
        finally:
            restore()


def capture_rng(tensors: list[torch.Tensor]) -> dict:
    """RNG state needed to replay a forward that sees ``tensors`` (CPU, plus their CUDA devices)."""
    state: dict = {"cpu": torch.get_rng_state()}
    devs = {t.device.index or 0 for t in tensors if t.is_cuda}
    if devs:
        state["cuda"] = {d: torch.cuda.get_rng_state(d) for d in devs}
    return state


def model_device(model: nn.Module) -> str:
    """The device type of ``model``'s first parameter or buffer ("cpu" for a model with neither)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device.type
    return "cpu"
