"""Model -> graph, by the first capture that works: torch.fx, then torch.export, then dispatch-level recording.

    cap = capture_any(model, args, kwargs)          # cap.mode in {"fx", "export", "dispatch"}; cap.notes say why
    cap = capture_any(model, args, kwargs, mode="export")

Every capture writes the same node meta (module path, user source line), so the analysis and rules never care
which one ran. Only fx graphs can be rewritten by ``fix``. The body of a function fx keeps opaque (torch.fx.wrap)
is spliced in by propagation (``ampaudit.capture.opaque``); export and dispatch see through such functions.
"""
from __future__ import annotations

from torch import nn

from ampaudit.capture.dispatch_capture import capture_dispatch
from ampaudit.capture.export_capture import capture_export
from ampaudit.capture.fx_capture import Capture, capture
from ampaudit.graph_meta import SourceLoc
from ampaudit.errors import CaptureError, UsageError
from ampaudit.policy import Policy, settings
from ampaudit.quiet import quiet

MODES = ("auto", "fx", "export", "dispatch")

__all__ = ["Capture", "SourceLoc", "capture", "capture_any", "capture_export", "capture_dispatch", "MODES"]


def export_unbacked_limit() -> int:
    """How many data-dependent sizes an export attempt may make before the dispatch capture takes over
    (rules/policy/settings.toml [capture])."""
    return int(settings()["capture"]["export_unbacked_limit"])


def capture_any(model: nn.Module, args: tuple, kwargs: dict, *, mode: str = "auto",
                policy: Policy | None = None) -> Capture:
    """Capture ``model`` with ``mode``, or (``auto``) with the first of fx, export, dispatch that succeeds.
    Export and dispatch run the forward under ``policy``'s autocast (:func:`ampaudit.simulate.target_autocast`)
    when given. In ``auto`` an export that keeps making data-dependent sizes (:func:`export_unbacked_limit`) is
    given up for the dispatch capture; ``mode="export"`` exports to the end."""
    if mode not in MODES:
        raise UsageError(f"unknown capture mode {mode!r}", hint=f"use one of {', '.join(MODES)}")
    attempts = {
        "fx": lambda: capture(model),
        "export": lambda: capture_export(model, args, kwargs, policy=policy,
                                         unbacked_limit=export_unbacked_limit() if mode == "auto" else None),
        "dispatch": lambda: capture_dispatch(model, args, kwargs, policy=policy),
    }
    order = list(attempts) if mode == "auto" else [mode]
    notes: list[str] = []
    for name in order:
        try:
            # Tracing, exporting and recording make torch warn about its own machinery; the user's warnings stay.
            with quiet():
                cap = attempts[name]()
        except CaptureError as exc:
            if mode != "auto" or name == order[-1]:
                raise
            notes.append(f"{name}: {exc.message}")
            continue
        cap.notes = notes + cap.notes
        return cap
    raise AssertionError("unreachable")
