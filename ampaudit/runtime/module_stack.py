"""Where an op runs: the innermost module whose own forward runs it, and the user's source line.

    names = module_names(model)               # {module: "blocks.0.attn"}, "" for the root
    with ModuleStack(model) as tracker:       # forward hooks on every module while active
        model(x)                              # tracker.current: the innermost running module's name
    user_source()                             # "net.py:9", the innermost frame of the model's code

With ``mark_nodes=True`` the stack also marks autograd sequence numbers, so a backward node can be mapped to
the module that created it (:meth:`ModuleStack.owner_of_node`), as the non-finite locator does.
"""
from __future__ import annotations

import bisect
import os
import re
import sys
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ampaudit.user_code import frame_kind, is_user_file, model_packages, LIBRARY, USER

_TB_FILE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>\S+))?')


def short_location(filename: str, line: int) -> str:
    try:
        rel = os.path.relpath(filename)
        filename = rel if not rel.startswith("..") else filename
    except ValueError:  # other drive on Windows
        pass
    return f"{filename}:{line}"


def model_location(frames: Iterable[tuple[str, int]], *, packages: frozenset[str] = frozenset(),
                   passed_over: Callable[[str], bool] | None = None) -> str | None:
    """``file:line`` of the model's code among ``frames`` ((file, line), innermost first): the first in the user's
    own files; failing that, the first in one of ``packages`` (the libraries the model's classes come from:
    :func:`ampaudit.user_code.model_packages`; transformers' attention, not an einops helper it calls), then in
    any installed library's; None when every frame is torch's, ampaudit's or Python's. The rule of
    :class:`ampaudit.capture.source_lines.SourceLines`, so a measured finding names a static one's line.

    ``passed_over`` (a test of a file name) makes the rule strict: only the frames whose file it accepts are
    passed over, and the first other frame is the answer when it is in the user's own files, None when it is not
    (no library fallback: the code that called in was ampaudit's, a library's or Python's)."""
    own = library = None
    for filename, line in frames:
        if passed_over is not None:
            if passed_over(filename):
                continue
            return short_location(filename, line) if is_user_file(filename) else None
        kind, package = frame_kind(filename)
        if kind == USER:
            return short_location(filename, line)
        if kind == LIBRARY:
            if own is None and package in packages:
                own = short_location(filename, line)
            library = library or short_location(filename, line)
    return own or library


def user_source(frame=None, *, stop=None, passed_over: Callable[[str], bool] | None = None,
                packages: frozenset[str] = frozenset()) -> str | None:
    """:func:`model_location` of the stack from ``frame`` (default: the caller's) outward, up to the frame
    running code object ``stop`` (the caller of the model: it and the frames outside it, such as the script that
    called ``check``, are not the model's code), under the strict rule when ``passed_over`` is given."""
    f = frame if frame is not None else sys._getframe(1)

    def frames():
        nonlocal f
        while f is not None and f.f_code is not stop:
            yield f.f_code.co_filename, f.f_lineno
            f = f.f_back

    return model_location(frames(), passed_over=passed_over, packages=packages)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def writer_source(own_file: str) -> str | None:
    """``file:line`` of the code that called into torch: the innermost frame outside torch and ``own_file`` (the
    caller's module), when it is the user's; None when it is not (an update the trainer's optimizer step made)."""
    return user_source(sys._getframe(1),
                       passed_over=lambda filename: filename == own_file or filename.startswith(_TORCH_DIR))


def source_from_lines(lines: list[str], *, stop=None, packages: frozenset[str] = frozenset()) -> str | None:
    """:func:`model_location` of formatted stack entries, outermost first (anomaly mode's "traceback_" metadata),
    counting only the entries inside the last one that runs code object ``stop``."""
    entries = [(m["file"], int(m["line"]), m["func"]) for m in map(_TB_FILE.search, lines) if m]
    if stop is not None:
        last = max((i for i, e in enumerate(entries) if (e[0], e[2]) == (stop.co_filename, stop.co_name)),
                   default=-1)
        entries = entries[last + 1:]
    return model_location(((file, line) for file, line, _ in reversed(entries)), packages=packages)


def module_names(root: nn.Module) -> dict[nn.Module, str]:
    """Module -> dotted path from ``named_modules()`` ("" for the root)."""
    names: dict[nn.Module, str] = {}
    for name, mod in root.named_modules():
        names.setdefault(mod, name)
    return names


class ModuleStack:
    """Forward hooks on every module of ``root`` tracking the innermost running module (while active)."""

    def __init__(self, root: nn.Module, *, mark_nodes: bool = False):
        self.names = module_names(root)
        self.packages = model_packages(root)     # the libraries whose lines model_location prefers
        self.stack: list[str] = []
        self.mark_nodes = mark_nodes
        self._seq: list[int] = []          # autograd sequence numbers where the innermost module changed
        self._owner: list[str] = []
        self._handles: list[Any] = []
        self._dummy = torch.zeros((), requires_grad=True)
        self.locator: Any = None     # paused while marking (a NonFiniteLocator)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _mark(self) -> None:
        if not self.mark_nodes:
            return
        if self.locator is not None:
            self.locator.paused = True
        try:
            with torch.enable_grad():
                seq = (self._dummy * 1).grad_fn._sequence_nr()
        finally:
            if self.locator is not None:
                self.locator.paused = False
        self._seq.append(seq)
        self._owner.append(self.current)

    def _pre(self, mod: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(mod, "?"))
        self._mark()

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            self.stack.pop()
        self._mark()

    def owner_of_node(self, node: Any) -> str | None:
        """Module whose forward created autograd ``node`` (None if unknown)."""
        if node is None or not self._seq:
            return None
        i = bisect.bisect_right(self._seq, node._sequence_nr()) - 1
        return self._owner[i] if i >= 0 else None

    def __enter__(self) -> "ModuleStack":
        for mod in self.names:
            self._handles.append(mod.register_forward_pre_hook(self._pre))
            self._handles.append(mod.register_forward_hook(self._post, always_call=True))
        self._mark()
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
