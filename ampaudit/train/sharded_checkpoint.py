"""Sharded checkpoints for FSDP runs: torch.distributed.checkpoint (DCP), atomic, loadable at another world size.

A sharded checkpoint is a directory ``<kind>-step-<N>/`` holding DCP's files (each rank writes its own shards of
the model and optimizer state) and ``trainer.pt`` (rank 0: step, data position, loss scaler, scheduler, every
rank's RNG states, the run's settings; plain data, ``weights_only`` loadable). A pointer file ``<kind>.json``
names the current directory and is replaced atomically only once every rank has finished writing, so a kill at
any instant leaves the previous checkpoint in force; superseded directories are removed afterwards. DCP reshards
on load, so a checkpoint written by 2 ranks loads into 1 or 4.

    path = save_sharded(model, optimizer, extra, Path("ckpt"), "last", step=12, is_main=rank == 0)
    extra = load_sharded(model, optimizer, Path("ckpt"), "last")
    has_sharded(Path("ckpt"), "last")
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ampaudit.errors import TrainError
from ampaudit.fileio import atomic_write, atomic_write_text

SHARDED_VERSION = 1
EXTRA = "trainer.pt"


def pointer(directory: Path, kind: str) -> Path:
    """The pointer file of checkpoint ``kind`` ("last", "halted")."""
    return Path(directory) / f"{kind}.json"


def has_sharded(directory: Path, kind: str = "last") -> bool:
    """Whether ``directory`` holds a sharded checkpoint of ``kind``."""
    return pointer(directory, kind).is_file()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], directory: Path,
                 kind: str, *, step: int, is_main: bool) -> Path:
    """Write a sharded checkpoint of ``kind`` and make it current; return its directory. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    target = directory / f"{kind}-step-{step:08d}"
    try:
        if is_main:
            directory.mkdir(parents=True, exist_ok=True)
            if target.exists():          # a save of this step that a kill interrupted: never pointed at
                shutil.rmtree(target)
        _barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
        if is_main:
            state = {"version": SHARDED_VERSION, **extra}
            atomic_write(target / EXTRA, lambda fh: torch.save(state, fh), error=TrainError,
                         hint="choose a writable checkpoint directory")
        _barrier()                       # every rank's shards are on disk before the pointer moves
        if is_main:
            atomic_write_text(pointer(directory, kind), json.dumps({"version": SHARDED_VERSION,
                                                                    "dir": target.name, "step": step}),
                              hint="choose a writable checkpoint directory")
            for old in directory.glob(f"{kind}-step-*"):
                if old != target and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
    except OSError as exc:
        raise TrainError(f"cannot write sharded checkpoint {target}: {exc.strerror or exc}",
                         hint="choose a writable checkpoint directory") from exc
    return target


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                 kind: str = "last") -> dict[str, Any]:
    """Load the current checkpoint of ``kind`` into ``model`` and ``optimizer`` (resharded to this world size);
    return the trainer's ``extra`` dict. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ptr = pointer(directory, kind)
    try:
        info = json.loads(ptr.read_text())
        target = Path(directory) / info["dir"]
        extra = torch.load(target / EXTRA, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise TrainError(f"sharded checkpoint not found: {exc.filename}", hint="check checkpoint_dir") from exc
    except (ValueError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError, EOFError, OSError) as exc:
        raise TrainError(f"cannot read sharded checkpoint {ptr}: {' '.join(str(exc).split())[:160]}",
                         hint="drop resume=True to start fresh, or point checkpoint_dir at an FSDP run's") from exc
    if not isinstance(extra, dict) or extra.get("version") != SHARDED_VERSION:
        raise TrainError(f"{target} is not an ampaudit sharded checkpoint (version {SHARDED_VERSION})",
                         hint="point checkpoint_dir at the directory an FSDP Trainer wrote")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(target))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise TrainError(f"sharded checkpoint does not fit this model/optimizer: {' '.join(str(exc).split())[:200]}",
                         hint="resume with the same model file and optimizer") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return extra
