"""Named plug-ins registered by decorator: the rules' matchers, the graph fixers and the source fixers.

    MATCHERS = Registry("matcher", providers=("ampaudit.rules.matchers.alignment", ...))

    @MATCHERS.register("linear_dims")        # or a module's own decorator that builds the entry
    def linear_dims(ctx, rule): ...

    MATCHERS.load()["linear_dims"]            # imports the providers once (each registers itself), then reads

A registry is a mapping of name to entry (tests may set or remove one). ``providers`` are the modules that
register the built-in entries, imported on :meth:`load` (the rule engine loads its matchers this way, the source
fix driver its fixers). Registering a name twice warns and the later entry wins (a plug-in may replace a built-in).

    MATCHERS       ampaudit/rules/registry.py     the matchers rules name (``matcher = ...``)
    FIXERS         ampaudit/rewrite/fixers.py     the ``autofix`` kinds ``ampaudit fix`` runs
    SOURCE_FIXERS  ampaudit/sourcefix/registry.py the ``source_fix`` kinds ``ampaudit fix --diff/--write`` runs
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(MutableMapping, Generic[T]):
    """Entries by name, filled by decorators in the ``providers`` modules (imported on :meth:`load`)."""

    def __init__(self, what: str, providers: tuple[str, ...] = ()):
        self.what = what
        self.providers = providers
        self._entries: dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T, *, stacklevel: int = 3) -> T:
        """Store ``entry`` under ``name``; a second entry of one name warns and replaces the first."""
        if name in self._entries:
            warnings.warn(f"{self.what} {name!r} registered twice; the later one wins", stacklevel=stacklevel)
        self._entries[name] = entry
        return entry

    def register(self, name: str, make: Callable[[Callable], T] | None = None) -> Callable[[Callable], Callable]:
        """A decorator registering the function it decorates under ``name``: as ``make(fn)`` when given (the
        entry a module builds around its function), else the function itself. Returns the function unchanged."""

        def decorate(fn: Callable) -> Callable:
            self.add(name, make(fn) if make is not None else fn, stacklevel=3)
            return fn

        return decorate

    def load(self) -> "Registry[T]":
        """Import the provider modules once (each registers its entries); the registry."""
        if not self._loaded:
            self._loaded = True
            for module in self.providers:
                importlib.import_module(module)
        return self

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __setitem__(self, name: str, entry: T) -> None:
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def copy(self) -> "Registry[T]":
        """A registry of the same entries and providers (loaded as this one is)."""
        other: Registry[T] = Registry(self.what, self.providers)
        other._entries, other._loaded = dict(self._entries), self._loaded
        return other

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.names()})"

