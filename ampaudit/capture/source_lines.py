"""Which frame of an op's stack names its source line: the user's own code, else the model's library code.

    lines = SourceLines(model)              # lines.packages: {"transformers"}, the model's module classes'
    lines.of_frames([(file, line), ...])    # innermost first -> SourceLoc or None
    lines.of_stack(node.meta["stack_trace"])   # an fx/export stack string, outermost first
    lines.of_running(sys._getframe(1), outermost)   # the running Python stack (fx tracing, dispatch recording)

Every capture asks this for every op (fx and dispatch from the running Python stack, export from each node's
``stack_trace``), with one answer:

1. the innermost frame in a user's file wins (a user's model, or the user's line that calls into a library's
   module: what the user can change);
2. failing that, the innermost frame in an installed library that one of the model's module classes comes from
   (a transformers model's ``modeling_llama.py``, not an ``einops`` helper it calls);
3. failing that, the innermost frame of any installed library;
4. else None (a model of torch modules only: no line, rather than the line of whatever called the audit).

Frames of torch, ampaudit and the standard library never count. The runtime locators follow the same rules
(:func:`ampaudit.runtime.module_stack.model_location`, told the model's packages by their
:class:`~ampaudit.runtime.module_stack.ModuleStack`), so a static and a measured finding on the same op of a
library model name the same line. The report marks a library's line as such (``ampaudit.rules.engine``).

Cost: a frame's kind is one dict lookup (:func:`ampaudit.user_code.frame_kind`); the ``SourceLoc`` of one code
location (its linecache read) is built once; an export stack string is parsed once however many nodes share it
(the aten ops of one Python line do).
"""
from __future__ import annotations

import linecache
import re
from typing import Iterable

from torch import nn

from ampaudit.graph_meta import SourceLoc
from ampaudit.user_code import LIBRARY, USER, frame_kind, model_packages

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n')


class SourceLines:
    """One capture's answers: ``lines = SourceLines(model)``, then ``lines.of_frames(frames)`` or
    ``lines.of_stack(text)`` per op. The caches live as long as the capture (a file ``fix`` edits is read anew by
    the next audit)."""

    def __init__(self, root: nn.Module | None = None):
        self.packages = model_packages(root)
        self._at: dict[tuple[str, int], SourceLoc] = {}
        self._stacks: dict[str, SourceLoc | None] = {}

    def at(self, filename: str, line: int) -> SourceLoc:
        """The SourceLoc of one code location, its source text read once."""
        loc = self._at.get((filename, line))
        if loc is None:
            loc = self._at[filename, line] = SourceLoc(filename, line, linecache.getline(filename, line).strip())
        return loc

    def of_frames(self, frames: Iterable[tuple[str, int]]) -> SourceLoc | None:
        """The source line of ``frames`` ((file, line), innermost first) by the rule of the module docstring."""
        own = other = None
        for filename, line in frames:
            kind, package = frame_kind(filename)
            if kind == USER:
                return self.at(filename, line)
            if kind == LIBRARY:
                if own is None and package in self.packages:
                    own = (filename, line)
                if other is None:
                    other = (filename, line)
        pick = own or other
        return self.at(*pick) if pick is not None else None

    def of_stack(self, stack: str | None) -> SourceLoc | None:
        """The source line of an fx/export ``stack_trace`` string (a traceback's frames, outermost first)."""
        if not stack:
            return None
        if stack not in self._stacks:
            frames = [(m.group(1), int(m.group(2))) for m in _FRAME_RE.finditer(stack)]
            self._stacks[stack] = self.of_frames(reversed(frames))
        return self._stacks[stack]

    def of_running(self, frame, outermost) -> SourceLoc | None:
        """The source line of the running stack from ``frame`` outward, short of ``outermost`` (the frame that
        started the model: it and its callers are not the model's code)."""
        def frames():
            f = frame
            while f is not None and f is not outermost:
                yield f.f_code.co_filename, f.f_lineno
                f = f.f_back

        return self.of_frames(frames())
