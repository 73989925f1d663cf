"""Ops a user's own GraphModule runs from its generated code: the module its tracer recorded for each of them.

A model the user traced with a tracer of their own (one that autowraps a utility module, keeps a submodule a leaf,
as HF's and timm's tracers do) comes as an ``fx.GraphModule`` whose generated forward is flat: the code of every
module that was not a leaf runs in it, so to a capture the running module is the GraphModule itself. Its nodes
still carry the module stack (``nn_module_stack``) and, where that tracer recorded them, the stack traces of the
code they came from; the generated code's line numbers say which node runs (``GraphModule._lineno_map``, as
torch.compile reads it back)::

    paths = GraphModulePaths(root)                  # nothing to look up when root holds no GraphModule
    module, stack = paths.of_running("", sys._getframe())   # ("scores", None): the op's node was Scores' code
    paths.of_stack("", node.meta["stack_trace"])            # "scores": the same, read from an exported node

A path is only ever one ``root.named_modules()`` holds (the innermost of the recorded stack that the GraphModule
kept), so reports name modules as everywhere else.
"""
from __future__ import annotations

import re
import types

import torch.fx as fx
from torch import nn


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


class GraphModulePaths:
    """The recorded origins of the ops that the GraphModules inside ``root`` run from their own forward."""

    def __init__(self, root: object):
        # forward's code object -> (the GraphModule's path, forward's first line, line -> node index, node metas)
        self._codes: dict[types.CodeType, tuple] = {}
        self._kept: dict[str, set[str]] = {}       # GraphModule path -> the submodule paths it holds
        self._by_file: dict[str, tuple] = {}        # forward's file -> the same entry, for of_stack
        if not isinstance(root, nn.Module):
            return
        for path, module in root.named_modules():
            lines = getattr(module, "_lineno_map", None) if isinstance(module, fx.GraphModule) else None
            code = getattr(getattr(type(module), "forward", None), "__code__", None)
            if lines and code is not None:
                self._codes[code] = (path, code.co_firstlineno, lines, [n.meta for n in module.graph.nodes])
                self._kept[path] = {name for name, _ in module.named_modules()}
        self._by_file = {code.co_filename: entry for code, entry in self._codes.items()}

    def of_running(self, module: str, frame: types.FrameType | None) -> tuple[str, str | None]:
        """``module`` (the running module's path), made the recorded owner of the op that ``frame``'s stack runs
        when ``module`` is a GraphModule running its own code; with that node's recorded stack trace, if any."""
        if module not in self._kept:
            return module, None
        while frame is not None and frame.f_code not in self._codes:
            frame = frame.f_back
        if frame is None:
            return module, None
        path, first, lines, metas = self._codes[frame.f_code]
        index = lines.get(frame.f_lineno - first)
        if path != module or index is None or index >= len(metas):
            return module, None
        meta = metas[index]
        return _join(path, self._owner(path, meta.get("nn_module_stack") or {})), meta.get("stack_trace")

    def of_stack(self, module: str, stack: str | None) -> str:
        """``module`` (the path an exported node's ``nn_module_stack`` gives) made the recorded owner where the
        node's ``stack_trace`` runs in a GraphModule's own code that ``module`` is not inside (export names no
        module for a GraphModule it runs nested, and reads the top one's own meta)."""
        if not self._codes or not stack:
            return module
        for filename, line in reversed(_FRAME_RE.findall(stack)):
            entry = self._by_file.get(filename)
            if entry is None:
                continue
            path, first, lines, metas = entry
            if module.startswith(path + ".") if path else module:
                return module            # inside a module the GraphModule called: export named it
            index = lines.get(int(line) - first)
            if index is None or index >= len(metas):
                return module
            return _join(path, self._owner(path, metas[index].get("nn_module_stack") or {}))
        return module

    def _owner(self, path: str, stack: dict) -> str:
        """The innermost module of a recorded ``nn_module_stack`` that the GraphModule at ``path`` still holds."""
        for entry in reversed(list(stack.values())):
            name = entry[0] if isinstance(entry, tuple) and entry else None
            if isinstance(name, str) and name in self._kept[path]:
                return name
        return ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
