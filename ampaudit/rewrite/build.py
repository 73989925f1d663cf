"""Turn a rewritten graph back into the user's module: same object tree, new forward.

    fixed = install_forward(work, gm)      # work's class becomes Fixed<Class>(<Class>) with gm's forward

The fixed module is the (copied) original module, not a GraphModule: a GraphModule keeps only the submodules
and attributes its graph touches, so unused parameters and buffers would drop out of ``state_dict``. Keeping the
original tree and swapping in a subclass whose ``forward`` is the generated code keeps every parameter and buffer
name, every hook and attribute, and lets torch.fx trace the new forward again (tracing reads ``type(m).forward``).
"""
from __future__ import annotations

import itertools
import linecache

import torch
import torch.fx as fx
from torch import nn

from ampaudit.errors import CaptureError

_counter = itertools.count()


def forward_source(gm: fx.GraphModule) -> tuple[str, dict]:
    """The generated ``def forward(self, ...)`` source and the globals it needs.

    Type annotations are dropped: under ``from __future__ import annotations`` they are strings naming objects
    of the user's module, which the written file could not import by those names.
    """
    for node in gm.graph.nodes:
        node.type = None
    code = gm.graph.python_code(root_module="self")
    return code.src, dict(code.globals)


def compile_forward(src: str, globals_: dict, label: str):
    """Compile ``src`` (which defines ``forward``) with its source registered so tracebacks show it."""
    filename = f"<ampaudit fix {label} {next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace = dict(globals_)
    exec(compile(src, filename, "exec"), namespace)
    return namespace["forward"]


def missing_attrs(work: nn.Module, gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensor constants the tracer stored on the GraphModule (``_tensor_constant0``) that ``work`` lacks."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            _resolve(work, node.target)
        except AttributeError:
            value = _resolve(gm, node.target)
            if not isinstance(value, torch.Tensor) or "." in node.target:
                raise CaptureError(f"the rewritten graph reads {node.target!r}, which the model does not have",
                                   hint="use ampaudit.keep_fp32(model, [...]) on the eager model instead")
            out[node.target] = value
    return out


def _resolve(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def fixed_class(base: type, forward) -> type:
    """``Fixed<Base>``: a subclass of the user's class whose forward is the rewritten one."""
    return type(f"Fixed{base.__name__}", (base,), {"forward": forward, "__module__": base.__module__,
                                                    "__doc__": f"{base.__name__} rewritten by ampaudit fix."})


def install_forward(work: nn.Module, gm: fx.GraphModule) -> nn.Module:
    """Give ``work`` (the copied original) the forward of ``gm``; returns ``work``."""
    for name, value in missing_attrs(work, gm).items():
        setattr(work, name, value)
    src, globals_ = forward_source(gm)
    forward = compile_forward(src, globals_, type(work).__name__)
    work.__class__ = fixed_class(type(work), forward)
    return work
