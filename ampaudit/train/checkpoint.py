"""Training checkpoints: atomic writes, RNG states, and loading with a clear error.

A checkpoint is one ``torch.save`` dict (``model``, ``optimizer``, ``scaler``, ``masters``, ``scheduler``,
``step``, ``data``, ``rng``, ``config``) holding only tensors and plain data, so it loads with
``torch.load(weights_only=True)``. It is written to a temporary file in the same directory, fsynced, then
renamed over the old one: a kill at any instant leaves either the previous checkpoint or the new one.

    path = save_checkpoint(state, Path("ckpt") / LAST)
    state = load_checkpoint(path)
    set_global_rng_state(state["rng"][rank])     # ampaudit.runtime.replay_state: the one owner of the RNGs
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from ampaudit.errors import TrainError
from ampaudit.fileio import atomic_write

CHECKPOINT_VERSION = 1
LAST = "last.pt"          # the latest periodic / interrupt checkpoint, what --resume reads
HALTED = "halted.pt"      # written when the loss scaler halts the run; last.pt keeps the last good state
DIAGNOSIS = "halt.json"


def save_checkpoint(state: dict[str, Any], path: Path) -> Path:
    """Write ``state`` atomically with ``torch.save``; return the path."""
    state = {"version": CHECKPOINT_VERSION, **state}
    return atomic_write(Path(path), lambda fh: torch.save(state, fh), error=TrainError,
                        hint="choose a writable location")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (tensors and plain data only)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise TrainError(f"checkpoint not found: {path}", hint="check checkpoint_dir") from exc
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as exc:
        first = " ".join(str(exc).split())[:160]
        raise TrainError(f"cannot read checkpoint {path}: {first}",
                         hint="it may be from another tool or truncated; drop resume=True to start fresh") from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise TrainError(f"{path} is not an ampaudit checkpoint (version {CHECKPOINT_VERSION})",
                         hint="point checkpoint_dir at the directory a Trainer wrote")
    return state
