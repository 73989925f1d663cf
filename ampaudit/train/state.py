"""The trainer's state: what a checkpoint holds, saving it (plain or sharded) and restoring it bit-identically.

:class:`TrainerState` is the half of :class:`~ampaudit.train.trainer.Trainer` that deals with checkpoints; it reads
the attributes declared below, which the trainer's constructor sets.

    trainer.save_checkpoint()                # checkpoint_dir/last.pt, or a sharded last-step-N/ under FSDP
    trainer.load_checkpoint()                # False when there is none
    weights = trainer.full_state_dict()      # FSDP shards gathered on rank 0
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of
from ampaudit.errors import TrainError, UsageError
from ampaudit.runtime.replay_state import global_rng_state, set_global_rng_state
from ampaudit.runtime.session import WatchSession
from ampaudit.train import ddp
from ampaudit.train import fsdp as fsdp_lib
from ampaudit.train.checkpoint import LAST, load_checkpoint, save_checkpoint
from ampaudit.train.data import DataStream
from ampaudit.train.masters import MasterWeights
from ampaudit.train.scaler import LossScaler
from ampaudit.train.sharded_checkpoint import has_sharded, load_sharded, save_sharded


class TrainerState:
    """Checkpoint methods of the trainer (a mixin: the trainer sets every attribute below)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: LossScaler
    masters: MasterWeights | None
    session: WatchSession
    dist: ddp.DistContext
    dtype: torch.dtype
    device: torch.device
    opt_level: str
    accum: int
    fsdp: bool
    step: int
    _stream: DataStream
    _checkpoint_dir: Path | None
    _saved_step: int | None

    def _config(self) -> dict[str, Any]:
        return {"dtype": name_of(self.dtype), "opt_level": self.opt_level,
                "accum": self.accum, "world_size": self.dist.world_size, "fsdp": self.fsdp}

    def _extra_state(self) -> dict[str, Any]:
        """Everything but the weights and optimizer state: what a sharded checkpoint holds beside DCP's shards.
        Collective (the RNG states are gathered)."""
        return {"step": self.step, "data": self._stream.position(), "scaler": self.scaler.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": ddp.gather(global_rng_state(), self.dist), "config": self._config(), **self._recipe_state()}

    def _recipe_state(self) -> dict[str, Any]:
        """A plan's layers: each one's current recipe (a fallback may have switched it) and the recipe statistics'
        first-step amaxes; {} for a model no plan converted."""
        from ampaudit.precision.convert import recipes_of

        recipes = recipes_of(self.model)
        return {"recipes": recipes, "recipe_stats": self.session.recipe_state()} if recipes else {}

    def _restore_recipes(self, state: dict[str, Any]) -> None:
        """Train each layer in the recipe it had at the checkpoint's step (the plan file may be newer)."""
        saved = state.get("recipes")
        if not saved:
            return
        from ampaudit.precision.convert import recipe_of, set_recipe
        from ampaudit.wrappers import unwrap

        modules = dict(unwrap(self.model).named_modules())
        missing = sorted(set(saved) - set(modules))
        if missing:
            raise TrainError(f"checkpoint names plan layer(s) {', '.join(missing[:3])} this model lacks",
                             hint="resume with the same model file and plan")
        for name, recipe in saved.items():
            if recipe_of(modules[name]) == {"choice": recipe["choice"], "gemms": dict(recipe.get("gemms") or {})}:
                continue
            set_recipe(modules[name], recipe["choice"], recipe.get("gemms"), name=name, device=self.device)
        self.session.restore_recipe_state(state.get("recipe_stats"))

    def state_dict(self) -> dict[str, Any]:
        """Everything a bit-identical resume needs. Collective under DDP: every rank must call it."""
        return {**self._extra_state(), "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "masters": self.masters.state_dict() if self.masters is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or checkpoint); the run must have the same dtype, opt level, accum, W."""
        mine, saved = self._config(), dict(state.get("config", {}))
        saved.setdefault("fsdp", False)
        if self.fsdp and saved["fsdp"]:
            # DCP reshards, so the world size may change; the data stream needs the same global batch.
            if saved.get("world_size", 1) * saved.get("accum", 1) == self.dist.world_size * self.accum:
                saved["world_size"], saved["accum"] = self.dist.world_size, self.accum
        diff = [f"{k} {saved.get(k)} -> {v}" for k, v in mine.items() if saved.get(k) != v]
        if diff:
            raise TrainError(f"checkpoint does not match this run: {', '.join(diff)}",
                             hint="resume with the settings it was written with (an FSDP checkpoint: the same "
                                  "ranks x accum), or drop resume=True")
        self._restore_recipes(state)
        if not self.fsdp:
            try:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise TrainError(f"checkpoint does not fit this model/optimizer: "
                                 f"{' '.join(str(exc).split())[:200]}",
                                 hint="resume with the same model file and optimizer") from exc
        self.scaler.load_state_dict(state["scaler"])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._stream.seek(state["data"])
        rng = state["rng"]
        set_global_rng_state(rng[self.dist.rank] if len(rng) == self.dist.world_size else rng[0])

    def save_checkpoint(self, name: str = LAST, directory: Path | None = None) -> Path | None:
        """Write the state atomically to ``directory/name`` (rank 0); return the path (None on other ranks)."""
        directory = directory or self._checkpoint_dir
        if directory is None:
            raise UsageError("no checkpoint directory", hint="pass checkpoint_dir=DIR")
        if name == LAST:
            self._saved_step = self.step
        if self.fsdp:       # every rank writes its shards; a pointer file makes the directory current
            path = save_sharded(self.model, self.optimizer, self._extra_state(), directory, Path(name).stem,
                                step=self.step, is_main=self.dist.is_main)
        else:
            state = self.state_dict()
            path = save_checkpoint(state, directory / name) if self.dist.is_main else None
            ddp.barrier(self.dist)
        if not self.dist.is_main:
            return None
        self.session.write("checkpoint", step=self.step, path=str(path))
        return path

    def has_checkpoint(self, name: str = LAST) -> bool:
        """Whether ``checkpoint_dir`` holds a checkpoint ``name`` this run can resume from."""
        if self._checkpoint_dir is None:
            return False
        if self.fsdp:
            return has_sharded(self._checkpoint_dir, Path(name).stem)
        return (self._checkpoint_dir / name).is_file()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model state_dict (FSDP shards gathered to rank 0, whose copy a plain model loads with
        ``weights_only=True``; other ranks get ``{}``). Collective under FSDP."""
        return fsdp_lib.full_state_dict(self.model)

    def load_checkpoint(self, name: str = LAST) -> bool:
        """Restore ``checkpoint_dir/name`` (sharded under FSDP) when it exists; whether it did. Collective."""
        if not self.has_checkpoint(name):
            return False
        if self.fsdp:
            self.load_state_dict(load_sharded(self.model, self.optimizer, self._checkpoint_dir, Path(name).stem))
        else:
            self.load_state_dict(load_checkpoint(self._checkpoint_dir / name))
        return True
