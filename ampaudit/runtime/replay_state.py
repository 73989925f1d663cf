"""Running a model again without side effects: its floating tensors, its buffers, its RNG, its device.

    with preserved(model, capture_rng(float_tensors(x))):   # buffers (BatchNorm stats) and RNG restored
        model(x)
    restore = buffer_snapshot(model); ...; restore()
    model_device(model)                                     # "cpu": where its parameters live

Every replay of ampaudit (the non-finite locator, the divergence probe, decisions, calibration, fix
verification) leaves the model and the RNG as it found them through these.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
    saved = {name: b.detach().clone() for name, b in root.named_buffers()}

    def restore() -> None:
        with torch.no_grad():
            for name, b in root.named_buffers():
                if name in saved and b.shape == saved[name].shape:
                    b.copy_(saved[name])
    return restore


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
