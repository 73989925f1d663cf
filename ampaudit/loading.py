"""The model-file protocol: turn what the user typed into a model, example inputs and training hooks.

    loaded = load_target("net.py")                        # build_model() / model / the only nn.Module in the file
    loaded = load_target("net.py", entry="Net")           # a factory, a class, or a module instance by name
    loaded = load_target("pkg.models:make_resnet")        # an importable factory
    loaded = load_target("net.py", inputs=["8x3x32x32"])  # shapes instead of example_inputs()
    loaded.model, loaded.args, loaded.kwargs, loaded.hook("train_data")

Loading a model file runs its code, as pytest does with test files. Every failure is a one-line
:class:`~ampaudit.errors.ModelLoadError` or :class:`~ampaudit.errors.InputError` that says what to do next.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ampaudit.dtypes import NAMES, by_name
from ampaudit.errors import InputError, ModelLoadError
from ampaudit.target_path import check_model_file, looks_like_file

PREFERRED_ENTRIES = ("build_model", "model")
INPUT_HOOK = "example_inputs"



@dataclass
class LoadedTarget:
    """A loaded model with its example inputs and the protocol functions found beside it."""

    model: nn.Module
    args: tuple
    kwargs: dict
    display: str
    path: Path | None = None
    namespace: dict = field(default_factory=dict)

    def hook(self, name: str) -> Callable | None:
        """A protocol function of the model file (``train_data``, ``loss_fn``, ``make_optimizer``,
        ``make_scheduler``, ``eval_data``, ``metric_fn``), or None."""
        value = self.namespace.get(name)
        return value if callable(value) else None


def _where(exc: BaseException, path: Path | None) -> str:
    """`` (file:line)`` of the deepest frame in the user's file, for error messages."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if path is not None and Path(frame.filename).resolve() == path:
            return f" ({path.name}:{frame.lineno})"
    return ""


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:240]}" if text else type(exc).__name__


def _exec_file(path: Path) -> dict:
    check_model_file(path)
    source = path.read_text(encoding="utf-8", errors="replace")
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ModelLoadError(f"syntax error in {path.name} line {exc.lineno}: {exc.msg}",
                             hint="fix the file and run again") from exc
    # A unique module name keeps two model files named model.py from clashing; the file's folder goes on sys.path so
    # its sibling imports work, as they would when the user runs it.
    name = f"_ampaudit_model_{abs(hash(str(path)))}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None, origin=str(path)))
    module.__file__ = str(path)
    sys.modules[name] = module
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        exec(code, module.__dict__)
    except Exception as exc:
        raise ModelLoadError(f"importing {path.name} raised {_describe(exc)}{_where(exc, path)}",
                             hint="fix the model file, or run it with python to see the full error") from exc
    return module.__dict__


def _import_spec(spec: str) -> tuple[dict, str | None]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModelLoadError(f"cannot import {module_name!r}: {exc}",
                             hint="install the package or run from its folder; a file path needs to end in .py") from exc
    except Exception as exc:
        raise ModelLoadError(f"importing {module_name} raised {_describe(exc)}", hint="fix the module") from exc
    return vars(module), (attr or None)


def _pick_entry(ns: dict, entry: str | None, display: str) -> tuple[str, Any]:
    if entry is not None:
        if entry not in ns:
            raise ModelLoadError(f"{display} has no {entry!r}", hint=f"choose one of: {_candidates(ns) or 'none found'}")
        return entry, ns[entry]
    for name in PREFERRED_ENTRIES:
        if name in ns:
            return name, ns[name]
    instances = [n for n, v in ns.items() if isinstance(v, nn.Module) and not n.startswith("_")]
    if len(instances) == 1:
        return instances[0], ns[instances[0]]
    tried = ", ".join(PREFERRED_ENTRIES)
    found = _candidates(ns)
    hint = f"name it with --entry (candidates: {found})" if found else "define build_model() returning the model, or pass --entry NAME"
    raise ModelLoadError(f"no model found in {display} (tried {tried}, and a single module-level nn.Module)", hint=hint)


def _candidates(ns: dict) -> str:
    names = [n for n, v in ns.items() if not n.startswith("_") and (
        isinstance(v, nn.Module) or (inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == ns.get("__name__"))
        or (inspect.isfunction(v) and v.__module__ == ns.get("__name__") and n != INPUT_HOOK))]
    return ", ".join(names[:8])


def _build(name: str, value: Any, display: str, path: Path | None) -> nn.Module:
    if isinstance(value, nn.Module):
        return value
    if not callable(value):
        raise ModelLoadError(f"{name} in {display} is a {type(value).__name__}, not a model or a factory",
                             hint="point --entry at an nn.Module or a function that returns one")
    try:
        model = value()
    except TypeError as exc:
        if "required positional argument" in str(exc) or "missing" in str(exc):
            raise ModelLoadError(f"{name}() in {display} needs arguments: {exc}",
                                 hint="give it defaults, or wrap it in a build_model() that takes none") from exc
        raise ModelLoadError(f"{name}() raised {_describe(exc)}{_where(exc, path)}", hint="fix the factory") from exc
    except Exception as exc:
        raise ModelLoadError(f"{name}() raised {_describe(exc)}{_where(exc, path)}", hint="fix the factory") from exc
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{name}() returned a {type(model).__name__}, not an nn.Module",
                             hint="return the model itself from the factory")
    return model


_INPUT_RE = re.compile(r"^\s*(\d+(?:\s*[x,]\s*\d+)*)\s*(?::\s*(\w+))?\s*$")


def parse_input_spec(spec: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """``"8x3x224x224"`` or ``"8x128:int64"`` -> a tensor (randn for floats, zeros for ints: always a valid index)."""
    m = _INPUT_RE.match(spec)
    if not m:
        raise InputError(f"cannot read --input {spec!r}", hint="write shapes like 8x3x224x224 or 8x128:int64")
    shape = tuple(int(d) for d in re.split(r"\s*[x,]\s*", m.group(1)))
    dtype_name = (m.group(2) or "float32").lower()
    dtype = by_name(dtype_name)
    if dtype is None:
        raise InputError(f"unknown dtype {dtype_name!r} in --input {spec!r}",
                         hint=f"use one of {', '.join(sorted(NAMES))}")
    try:
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)
    except RuntimeError as exc:  # a shape too large to allocate
        raise InputError(f"cannot make a tensor for --input {spec!r}: {_describe(exc)}",
                         hint="pass a smaller shape; the batch size need not be the training one") from exc


_EXPECTED_INPUTS = "expected a tuple of tensors, a tensor, or a dict of keyword arguments"


def _normalize_inputs(value: Any, display: str) -> tuple[tuple, dict]:
    if not isinstance(value, (torch.Tensor, tuple, list, dict)):
        kind = "None" if value is None else type(value).__name__
        raise InputError(f"example_inputs() in {display} returned {kind}; {_EXPECTED_INPUTS}",
                         hint="return e.g. (torch.randn(8, 64),) from example_inputs(), or pass --input 8x64")
    if isinstance(value, dict):
        args, kwargs = (), dict(value)
    else:
        if not isinstance(value, tuple):
            value = tuple(value) if isinstance(value, list) else (value,)
        # A (args, kwargs) pair is accepted as well: it is how forward with keyword arguments is usually written down.
        if len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
            args, kwargs = tuple(value[0]), dict(value[1])
        else:
            args, kwargs = value, {}
    # Non-tensor arguments (a flag, None for an optional mask) are fine beside tensors, but not instead of them.
    leaves = tree_flatten((args, kwargs))[0]
    if not any(isinstance(v, torch.Tensor) for v in leaves):
        kinds = ", ".join(sorted({"None" if v is None else type(v).__name__ for v in leaves}))
        what = f"only {kinds}" if leaves else "it is empty"
        raise InputError(f"example_inputs() in {display} holds no tensors ({what}); {_EXPECTED_INPUTS}",
                         hint="return e.g. (torch.randn(8, 64),) from example_inputs(), or pass --input 8x64")
    return args, kwargs


def _example_inputs(ns: dict, inputs: list[str] | None, display: str, path: Path | None) -> tuple[tuple, dict]:
    if inputs:
        return tuple(parse_input_spec(s) for s in inputs), {}
    fn = ns.get(INPUT_HOOK)
    if fn is None:
        raise InputError(f"no example inputs for {display}",
                         hint="define example_inputs() returning a tuple of tensors, or pass --input 8x3x224x224")
    try:
        value = fn() if callable(fn) else fn
    except Exception as exc:
        raise InputError(f"example_inputs() raised {_describe(exc)}{_where(exc, path)}",
                         hint="fix example_inputs(), or pass --input SHAPE") from exc
    return _normalize_inputs(value, display)


def check_signature(model: nn.Module, args: tuple, kwargs: dict, display: str) -> None:
    """Raise InputError when ``args``/``kwargs`` cannot be bound to ``model.forward``."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # builtins and C++ modules: let the forward itself decide
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        params = ", ".join(p for p in sig.parameters)
        given = f"{len(args)} positional" + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        raise InputError(f"example inputs ({given}) do not fit {type(model).__name__}.forward({params}): {exc}",
                         hint="make example_inputs() match forward, or pass one --input per argument") from exc


def load_target(target: str, *, entry: str | None = None, inputs: list[str] | None = None,
                need_inputs: bool = True) -> LoadedTarget:
    """Load ``target`` (a ``.py`` path or ``pkg.module[:factory]``) under the model-file protocol."""
    target = str(target)
    path: Path | None = None
    if looks_like_file(target):
        path = Path(target).expanduser().resolve()
        ns = _exec_file(path)
        display = Path(target).name
    else:
        ns, attr = _import_spec(target)
        entry = entry or attr
        display = target
    name, value = _pick_entry(ns, entry, display)
    model = _build(name, value, display, path)
    args, kwargs = _example_inputs(ns, inputs, display, path) if need_inputs else ((), {})
    if need_inputs:
        check_signature(model, args, kwargs, display)
    return LoadedTarget(model=model, args=args, kwargs=kwargs, display=display, path=path, namespace=ns)
