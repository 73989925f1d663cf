"""One training run's settings: :class:`TrainConfig`, shared by ``ampaudit train``, the Trainer and the callbacks.

    config = TrainConfig(dtype="bfloat16", accum=4, clip_norm=1.0, trace="run.jsonl")
    Trainer(model, loss_fn, train_data, config=config)
    Trainer(model, loss_fn, train_data, dtype="bfloat16", accum=4)        # the same: keywords are config fields
    config = load_train_config(Path("run.toml"))                           # ampaudit train --config run.toml
    AmpAuditCallback(config=config)                                        # the trace settings, in Lightning

A TOML file holds the fields below that a file can hold (numbers, strings, booleans, paths, lists of class
names) at its top level, spelled with underscores or dashes (``clip_norm`` or ``clip-norm``); ``checkpoint`` is
``checkpoint_dir`` and ``clip_per_layer = true`` is ``clip_mode = "layer"``, as the flags spell them. Relative
paths are relative to the file. Values are checked by the Trainer as keyword arguments are; a key the file
cannot hold, or a value of the wrong type, is a :class:`~ampaudit.errors.ConfigError` naming the file and key.
Fields the Trainer itself does not read (``steps``, ``epochs``, ``resume``, ``save``, ``tensorboard``, ``plan``,
``pad``) are what ``ampaudit train`` does around it.
"""
from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.errors import ConfigError

_PATH = "path"          # a file kind: a string, made a Path relative to the TOML file
_NAMES = "names"        # a file kind: a list of class names (or one "A,B" string)


def _opt(default: Any, *kinds: Any) -> Any:
    """A field a TOML file may set, to a value of one of ``kinds``."""
    return field(default=default, metadata={"file": kinds})


@dataclass
class TrainConfig:
    """Every setting of a training run (see the module docstring for files; README's train section for meaning)."""

    # precision and the loss scale
    dtype: Any = _opt("float16", str)                   # float16, bfloat16, float32 (or a torch.dtype)
    opt_level: str = _opt("O1", str)
    loss_scale: Any = _opt("auto", str, float)          # auto, dynamic, none, a number, or a LossScaler
    max_consecutive_skips: int | None = _opt(50, int)
    init_scale: float | None = _opt(None, float)        # None: LossScaler's default
    growth_factor: float | None = _opt(None, float)
    backoff_factor: float | None = _opt(None, float)
    growth_interval: int | None = _opt(None, int)
    hysteresis: int | None = _opt(None, int)
    min_scale: float | None = _opt(None, float)
    max_scale: float | None = _opt(None, float)
    skip_window: int | None = _opt(None, int)
    max_skip_fraction: float | None = _opt(None, float)
    # the step: accumulation, clipping, learning rate
    accum: int = _opt(1, int)
    clip_norm: float | None = _opt(None, float)
    clip_value: float | None = _opt(None, float)
    clip_mode: str = _opt("norm", str)                  # norm or layer (with clip_norm)
    lr: float | None = _opt(None, float)
    warmup_steps: int | None = _opt(None, int)
    scale_lr: str | None = _opt(None, str)
    base_batch: int | None = _opt(None, int)
    micro_batch: int | None = _opt(None, int)
    # the model's transforms and placement (ampaudit.train.transforms applies them in order)
    device: Any = _opt(None, str)
    checkpoint_activations: Any = _opt(None, str, _NAMES)
    compile: Any = _opt(False, bool, str)               # True, or a backend name such as "aot_eager"
    fsdp: bool = _opt(False, bool)
    fsdp_wrap: list[str] | None = _opt(None, _NAMES)
    reduce_dtype: Any = _opt("float32", str)
    sync_bn: bool = _opt(False, bool)
    preflight: bool = _opt(True, bool)
    # the watch
    trace: Any = _opt(None, _PATH)                      # a path, or a TraceWriter
    trace_every: int = _opt(50, int)
    divergence_every: int | None = _opt(None, int)
    fp8_fallback: bool = _opt(False, bool)            # a plan's layer leaving its budget switches to a safer recipe
    plan_file: Any = _opt(None, _PATH)                  # the plan a fallback rewrites (ampaudit train: --plan's)
    # checkpoints, evaluation, the console
    checkpoint_dir: Any = _opt(None, _PATH)
    checkpoint_every: int | None = _opt(None, int)
    eval_every: int | None = _opt(None, int)
    progress: bool = _opt(False, bool)
    handle_signals: bool = True
    meta: dict[str, Any] | None = None
    # functions of the run (not in files): factories, data, metrics
    optimizer: Callable | Any = None
    scheduler: Callable | None = None
    eval_data: Any = None
    metric_fn: Callable | None = None
    # what ampaudit train does around the Trainer
    steps: int | None = _opt(None, int)
    epochs: int | None = _opt(None, int)
    resume: bool = _opt(False, bool)
    save: Path | None = _opt(None, _PATH)
    tensorboard: Path | None = _opt(None, _PATH)
    plan: Path | None = _opt(None, _PATH)
    pad: bool = _opt(False, bool)

    def scaler_options(self) -> dict[str, Any]:
        """The loss-scale policy's settings that differ from :class:`~ampaudit.train.scaler.LossScaler`'s."""
        return {name: getattr(self, name) for name in SCALER_FIELDS if getattr(self, name) is not None}

    def watch_options(self) -> dict[str, Any]:
        """What a watch session takes from the run: trace, statistics interval, FP32 shadow interval."""
        return {"trace": self.trace, "every": self.trace_every, "divergence_every": self.divergence_every}


SCALER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale",
                 "max_scale", "skip_window", "max_skip_fraction")
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
FILE_KEYS = {name: f.metadata["file"] for name, f in FIELDS.items() if "file" in f.metadata}
ALIASES = {"checkpoint": "checkpoint_dir"}      # the flag's spelling


def from_keywords(config: TrainConfig | None, options: dict[str, Any], *, owner: str = "Trainer") -> TrainConfig:
    """``config`` (default: the defaults) with the keyword arguments ``options`` on top: the one place the
    Trainer's keyword API maps onto the config. ``scaler_options={...}`` sets the scale-policy fields."""
    options = dict(options)
    scaler = options.pop("scaler_options", None) or {}
    unknown = [k for k in (*options, *scaler) if k not in FIELDS or (k in scaler and k not in SCALER_FIELDS)]
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return dataclasses.replace(config or TrainConfig(), **options, **scaler)


def _check_kind(value: Any, kinds: tuple, base: Path) -> Any:
    """``value`` as the field wants it, or None when it is of none of ``kinds``."""
    for kind in kinds:
        if kind is _PATH and isinstance(value, str):
            return base / value
        if kind is _NAMES and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value
        if kind is _NAMES and isinstance(value, str) and value.strip():
            return [v.strip() for v in value.split(",") if v.strip()]
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind in (int, str, bool) and type(value) is kind:
            return value
    return None


def _kind_names(kinds: tuple) -> str:
    said = {_PATH: "a path string", _NAMES: "a list of class names", int: "an integer", float: "a number",
            str: "a string", bool: "true or false"}
    return " or ".join(said[k] for k in kinds)


def config_values(table: dict[str, Any], path: Path) -> dict[str, Any]:
    """The fields a TOML table sets, checked and converted (see the module docstring); ConfigError otherwise."""
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name == "clip_per_layer" and isinstance(value, bool):
            values["clip_mode"] = "layer" if value else "norm"
            continue
        if name not in FILE_KEYS:
            near = difflib.get_close_matches(name, [*FILE_KEYS, *ALIASES, "clip_per_layer"], n=1)
            where = "a function of the model file, not a setting" if name in FIELDS else "not a setting of train"
            raise ConfigError(f"{path}: unknown key {key!r} ({where})",
                              hint=f"did you mean {near[0]!r}?" if near else
                              "keys are ampaudit train's options with underscores, e.g. accum = 4")
        converted = _check_kind(value, FILE_KEYS[name], path.parent)
        if converted is None:
            raise ConfigError(f"{path}: {key!r} must be {_kind_names(FILE_KEYS[name])}, got {value!r}",
                              hint=f"fix {key} in {path.name}")
        values[name] = converted
    return values


def load_train_config(path: Path, base: TrainConfig | None = None) -> TrainConfig:
    """``base`` (default: the defaults) with the settings of the TOML file ``path`` on top."""
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"no config file {path}", hint="give the path of a TOML file of the run's settings") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:     # tomllib reads UTF-8 only
        raise ConfigError(f"{path}: cannot read it as TOML: {' '.join(str(exc).split())}",
                          hint="fix the file (TOML: key = value, one a line)") from None
    return dataclasses.replace(base or TrainConfig(), **config_values(table, Path(path)))


__all__ = ["TrainConfig", "from_keywords", "load_train_config", "config_values", "FILE_KEYS", "SCALER_FIELDS"]
