"""When ``ampaudit.watch`` runs a divergence check, which scopes the check includes, and running it.

    schedule = DivergenceSchedule(root, names, device_type="cpu", every=50, grad_every=8, local_every=2,
                                  composite_every=8)
    probe = schedule.begin(step, autocast_on, autocast_dtype)      # before the real forward; None if not due
    ...                                                            # the real forward (+ backward)
    events = schedule.finish(probe, args, kwargs, rng_state, upstream)   # FP32 shadow: ``divergence`` fields

A check runs on every step that is a multiple of ``every`` and runs under autocast (a step is checked once
even if it makes several forwards). Every check compares each module's output with FP32 (scope
``global``). The costlier scopes are counted in checks, starting with check 0, which has them all:
``grad_every`` (the FP32 backward, scope ``grad``), ``local_every`` (each leaf module's own error: re-run in
low precision on its FP32 inputs, scope ``local``) and ``composite_every`` (on checks with the local scope:
the composites' own errors too, each re-run with the modules it calls in FP32); None turns a scope off. A
composite's re-run costs an FP32 forward of its subtree, so all of them together cost one forward per nesting
level: the first composite check re-runs every composite, the later ones one nesting depth each in turn (root,
its children, their children, ...), about one FP32 forward per check, every composite measured again once per
turn. One
:class:`~ampaudit.runtime.divergence.DivergenceProbe` per autocast dtype is reused check after check.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from ampaudit.errors import UsageError
from ampaudit.runtime.divergence import DivergenceProbe
from ampaudit.runtime.fp32_floor import mark_local_rows


def _composites_by_depth(names: dict[nn.Module, str]) -> list[frozenset[nn.Module]]:
    """Modules with children, grouped by nesting depth (the root first)."""
    depth: dict[int, set[nn.Module]] = {}
    for mod, name in names.items():
        if next(mod.children(), None) is not None:
            depth.setdefault(name.count(".") + 1 if name else 0, set()).add(mod)
    return [frozenset(depth[d]) for d in sorted(depth)]


class DivergenceCheckWarning(UserWarning):
    """A divergence check failed; training goes on without that check's events."""


def check_every(name: str, value: Any, *, optional: bool) -> None:
    """Raise :class:`UsageError` unless ``value`` is a positive integer (or None where ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "a positive integer or None" if optional else "a positive integer"
        raise UsageError(f"watch(): {name} must be {what}, got {value!r}",
                         hint="it counts divergence checks: 1 = on every check"
                         if name in ("grad_divergence_every", "local_divergence_every",
                                     "composite_divergence_every") else None)


class DivergenceSchedule:
    """Divergence checks of one watched model; see the module docstring."""

    def __init__(self, root: nn.Module, names: dict[nn.Module, str], *, device_type: str, every: int | None,
                 grad_every: int | None, local_every: int | None, composite_every: int | None = None):
        self.root, self.names, self.device_type = root, names, device_type
        self.every, self.grad_every, self.local_every = every, grad_every, local_every
        self.composite_every = composite_every
        self._depths = _composites_by_depth(names)
        self._composite_checks = 0
        self.checks = 0                  # checks begun: picks the ones with the grad / local scopes
        self._last_step: int | None = None
        self._probes: dict[torch.dtype, DivergenceProbe] = {}

    def begin(self, step: int, autocast_on: bool, dtype: torch.dtype) -> DivergenceProbe | None:
        """Before a forward: the probe recording it if a check is due at ``step``, else None."""
        if self.every is None or not autocast_on or step % self.every or step == self._last_step:
            return None
        self._last_step = step
        check, self.checks = self.checks, self.checks + 1
        grads = self.grad_every is not None and check % self.grad_every == 0
        local = self.local_every is not None and check % self.local_every == 0
        composites = self._composites_due(local and self.composite_every is not None
                                          and check % self.composite_every == 0)
        probe = self._probes.get(dtype)
        if probe is None:
            probe = self._probes[dtype] = DivergenceProbe(
                self.root, device_type=self.device_type, dtype=dtype,
                local=True if self.composite_every is not None else "leaves", names=self.names)
        probe.begin(capture_grads=grads and torch.is_grad_enabled(), local=local, composites=composites)
        return probe

    def _composites_due(self, due: bool) -> frozenset[nn.Module] | bool:
        if not due or not self._depths:
            return False
        turn, self._composite_checks = self._composite_checks, self._composite_checks + 1
        return True if turn == 0 else self._depths[(turn - 1) % len(self._depths)]

    def finish(self, probe: DivergenceProbe, args: tuple, kwargs: dict, rng_state: dict | None,
               upstream: list[torch.Tensor | None]) -> list[dict]:
        """After the pass (after backward, before the optimizer step): run the FP32 shadow, return the
        ``divergence`` event fields. ``upstream``: d loss / d output per output (the ``grad`` scope).

        A check that raises (a model whose FP32 run fails, an in-place update the FP32 backward refuses)
        gives a :class:`DivergenceCheckWarning` and no events: a diagnostic must not stop the training.
        """
        grads = probe.capture_grads and any(g is not None for g in upstream)
        try:
            # After backward the real activations are freed. Without the gradient scope the shadow runs
            # under no_grad: no FP32 graph is kept.
            probe.shadow(args, kwargs, rng_state=rng_state, grad=grads)
            if grads:
                probe.grads(upstream)
            rows = probe.events()
            # Would-be culprits whose FP32 output FP32's own rounding moves (an untrained decoder's norms): the
            # report leaves them out, as check --calibrate does.
            mark_local_rows(self.root, args, kwargs, rows, probe.dtype)
            return rows
        except Exception as exc:  # noqa: BLE001 - reported, and the training loop goes on
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"ampaudit.watch: the divergence check at step {self._last_step} failed "
                          f"({type(exc).__name__}: {first[:200]}); training continues without it",
                          DivergenceCheckWarning, stacklevel=2)
            return []
        finally:
            probe.close()

    def close(self) -> None:
        """Remove the hooks of a check still open."""
        for probe in self._probes.values():
            probe.close()
