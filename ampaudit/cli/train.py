"""``ampaudit train``: train a model file under mixed precision with the loss-scale policy, clipping,
accumulation, master weights, checkpoints and an optional trace.

    ampaudit train model.py --steps 1000 --dtype float16 --accum 4 --clip-norm 1.0 \\
        --checkpoint ckpt --checkpoint-every 100 --trace run.jsonl --save final.pt
    torchrun --nproc-per-node 2 -m ampaudit train model.py --steps 1000 --accum 2
    torchrun --nproc-per-node 2 -m ampaudit train model.py --steps 1000 --fsdp --dtype bfloat16 --checkpoint ckpt
    torchrun --nproc-per-node 2 -m ampaudit train model.py --fsdp --preflight-only
    ampaudit train model.py --config run.toml --steps 50      # the file's settings; flags given here win

The model file provides ``train_data()`` and ``loss_fn(output, target)`` (and optionally ``make_optimizer(params)``,
``make_scheduler(optimizer)``, and for ``--eval-every`` ``eval_data()`` and ``metric_fn(output, target) -> dict``).
The settings are one :class:`~ampaudit.train.config.TrainConfig`: defaults, then ``--config FILE`` (TOML), then
the flags given on the command line. Exit codes: 0 done, 2 error, 3 halted by the loss scaler, 128+N on signal N; ``--preflight-only``: 0 when every check
passes, 1 when one fails.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors
from ampaudit.errors import AmpAuditError, TrainError, UsageError
from ampaudit.fileio import atomic_write, writable_as

if TYPE_CHECKING:      # ampaudit.train loads the trainer: only train itself imports it
    from ampaudit.train.config import TrainConfig


def _hooks(loaded) -> tuple:
    """``train_data`` and ``loss_fn`` from the model file, or a TrainError showing what to add."""
    missing = [name for name in ("train_data", "loss_fn") if loaded.hook(name) is None]
    if missing:
        example = {"train_data": "def train_data(): yield inputs, target",
                   "loss_fn": "def loss_fn(output, target): return torch.nn.functional.mse_loss(output, target)"}
        raise TrainError(f"{loaded.display} has no {' and no '.join(m + '()' for m in missing)}; ampaudit train needs "
                         "batches and a loss from the model file",
                         hint="add to it: " + "; ".join(example[m] for m in missing))
    return loaded.hook("train_data"), loaded.hook("loss_fn")


def _apply_plan(loaded, path: Path | None, dtype: str, device: str | None, pad: bool = False) -> str:
    """Convert the model as the plan says (planning first for --dtype float8); the dtype the rest trains in."""
    from ampaudit.planning.apply import load_plan
    from ampaudit.train.transforms import apply_plan

    if dtype not in ("float8", "bfloat16", "float16"):
        raise UsageError(f"--plan trains its other layers under bf16 autocast, not {dtype}",
                         hint="drop --dtype, or use --dtype bfloat16")
    if path is not None:
        data = load_plan(path)
    else:
        from ampaudit.analysis.calibrate import batches_from
        from ampaudit.planning.api import plan as make_plan

        # Measured on the first batches of train_data(); measuring changes nothing in the model.
        data = make_plan(loaded.model, batches_from(loaded, 4), loss_fn=loaded.hook("loss_fn"), pad=pad).to_dict()
    target = device or _default_device()
    chosen = apply_plan(loaded.model, data, device=target, pad=pad)
    padded = chosen.get("padded") or {}
    from collections import Counter

    from ampaudit.precision.convert import emulation_notes, recipes_of
    from ampaudit.precision.recipes import HIGH_PRECISION, recipe

    other = Counter(r["choice"] for r in recipes_of(loaded.model).values()
                    if r["choice"] not in HIGH_PRECISION and recipe(r["choice"]).family != "float8")
    typer.echo(f"plan: {len(chosen['float8'])} float8 layer(s)"
               + (f" ({len(padded)} padded: {'; '.join(c.describe() for c in padded.values())})" if padded else "")
               + "".join(f", {n} {name}" for name, n in other.items())
               + f", {len(chosen['float32'])} float32, the rest bf16", err=True)
    for note in emulation_notes(loaded.model):
        typer.echo(note, err=True)
    return "bfloat16"


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _save_weights(state: dict, path: Path) -> None:
    import torch

    atomic_write(path, lambda fh: torch.save(state, fh))


@app.command()
@cli_errors
def train(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    *,
    config: Annotated[Optional[Path], typer.Option(help="A TOML file of settings: train's options as keys with underscores (accum = 4, clip_norm = 1.0, checkpoint = \"ckpt\"); flags given here override them.")] = None,
    entry: Annotated[Optional[str], typer.Option(help="Name of the factory/model in the file.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps to train (each of --accum micro-batches).")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="Passes over train_data() instead of --steps.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Low-precision dtype: float16, bfloat16, float8 (plans first, as ampaudit plan does with its defaults, then trains the plan), or float32 [default: bfloat16 where the device multiplies it natively (CUDA sm_80+, AMX/AVX512-BF16 CPUs), else float16].", show_default=False)] = None,
    plan: Annotated[Optional[Path], typer.Option(help="A plan from ampaudit plan -o (version 1 or 2): each layer trains in its recipe through torchao (float8_tensorwise, float8_rowwise, float8_rowwise_with_gw_hp, mxfp8, nvfp4, blockwise; per-GEMM choices), its float32 layers in fp32, the rest under bf16 autocast.")] = None,
    opt_level: Annotated[str, typer.Option("--opt-level", help="O1: fp32 weights + autocast; O2: low-precision "
                                           "weights with FP32 master weights, BatchNorm in fp32.")] = "O1",
    accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step (gradient accumulation).")] = 1,
    clip_norm: Annotated[Optional[float], typer.Option(help="Clip the global gradient L2 norm to this.")] = None,
    clip_value: Annotated[Optional[float], typer.Option(help="Clip each gradient element to +-this.")] = None,
    clip_per_layer: Annotated[bool, typer.Option(help="With --clip-norm: clip each layer's norm separately.")] = False,
    lr: Annotated[Optional[float], typer.Option(help="Learning rate (overrides make_optimizer's).")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option(help="Ramp the LR linearly from 0 over the first N optimizer steps (on top of make_scheduler's).")] = None,
    scale_lr: Annotated[Optional[str], typer.Option(help="Scale the LR to the effective batch (micro-batch x --accum x ranks) from --base-batch: linear or sqrt.")] = None,
    base_batch: Annotated[Optional[int], typer.Option(help="The batch the LR was tuned at, for --scale-lr.")] = None,
    checkpoint_activations: Annotated[Optional[str], typer.Option(help="Activation checkpointing (non-reentrant; autocast and RNG preserved in the recompute): auto (also the bare flag) for the model's repeated blocks, or CLASS,... to name them.")] = None,
    sync_bn: Annotated[bool, typer.Option("--sync-bn", help="Under torchrun: BatchNorm computes its statistics over every rank's micro-batch (SyncBatchNorm; gloo on CPU too).")] = False,
    eval_every: Annotated[Optional[int], typer.Option(help="Every N steps evaluate eval_data() under autocast and in FP32 (same weights, eval mode): both losses, metrics (metric_fn, else top-1/top-5) and their gap, as an eval event in the trace.")] = None,
    loss_scale: Annotated[str, typer.Option(help="dynamic, none, a fixed number, or auto (dynamic for "
                                            "float16, none for bfloat16).")] = "auto",
    max_consecutive_skips: Annotated[int, typer.Option(help="Halt (exit 3) after this many skipped steps "
                                                       "in a row.")] = 50,
    max_skip_fraction: Annotated[Optional[float], typer.Option(help="Also halt when this fraction of the last "
                                                               "--skip-window steps were skipped.")] = None,
    skip_window: Annotated[int, typer.Option(help="Window for --max-skip-fraction.")] = 100,
    init_scale: Annotated[float, typer.Option(help="Initial dynamic loss scale.")] = 2.0 ** 16,
    growth_interval: Annotated[int, typer.Option(help="Clean steps before the scale grows.")] = 2000,
    hysteresis: Annotated[int, typer.Option(help="Overflows tolerated before the scale backs off.")] = 1,
    min_scale: Annotated[float, typer.Option(help="The scale never backs off below this.")] = 1.0,
    max_scale: Annotated[float, typer.Option(help="The scale never grows above this.")] = 2.0 ** 24,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="Write a JSON Lines trace here (turns on watch hooks).")] = None,
    trace_every: Annotated[int, typer.Option(help="Collect tensor statistics every N steps.")] = 50,
    divergence_every: Annotated[Optional[int], typer.Option(help="Compare every module with an FP32 shadow "
                                                            "forward every N steps (needs --trace and O1).")] = None,
    pad: Annotated[bool, typer.Option("--pad", help="With --plan or --dtype float8: pad the misaligned layers the plan keeps out of float8 only for alignment (zero rows and columns, the same outputs) and train them in float8; --save writes the unpadded shapes.")] = False,
    fallback: Annotated[bool, typer.Option("--fallback", "--fp8-fallback", help="With --plan and --trace: a low-precision layer that leaves its budget on a sampled step (output SQNR vs an FP32 shadow, flushed share, amax growth) trains in the next safer recipe from the next step (recipes.toml, ending in bf16); logged in the trace, and the --plan file is rewritten.")] = False,
    tensorboard: Annotated[Optional[Path], typer.Option(help="When training ends, also write the trace's scalars (loss, scale, skips, grad norm, per-module headroom and divergence) as TensorBoard logs here (needs --trace and the tensorboard extra).")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint directory (last.pt, halted.pt).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Write a checkpoint every N steps.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from --checkpoint DIR/last.pt when it exists.")] = False,
    save: Annotated[Optional[Path], typer.Option(help="Write the final model.state_dict() here.")] = None,
    progress: Annotated[Optional[bool], typer.Option(help="Show a progress bar (default: when stderr is a "
                                                     "terminal).")] = None,
    fsdp: Annotated[bool, typer.Option("--fsdp", help="Shard with FSDP2 (fully_shard) instead of DDP: fp32 shards "
                                       "are the master weights, the dtype is for compute; checkpoints are sharded (DCP).")] = False,
    fsdp_wrap: Annotated[Optional[str], typer.Option(help="With --fsdp: module classes to shard one by one, comma-separated (default: the model's repeated blocks).")] = None,
    reduce_dtype: Annotated[str, typer.Option(help="With --fsdp: dtype gradients are reduce-scattered in.")] = "float32",
    compile: Annotated[bool, typer.Option("--compile", help="Run the forward through torch.compile (the watch sees eager runs of its sampled steps).")] = False,
    preflight_only: Annotated[bool, typer.Option("--preflight-only", help="Run the precision preflight (FP32 masters, FSDP group dtypes, reduce dtype, memory per rank, all-reduce self-test), print one line per check, exit 0/1.")] = False,
) -> None:
    """Train a model file under mixed precision: loss scaling, clipping, accumulation, master weights, resume."""
    flags = {k: v for k, v in locals().items() if k not in ("ctx", "target", "entry", "config", "preflight_only")}
    cfg = _settings(ctx, flags, config)
    _check(cfg, preflight_only)
    from ampaudit.target_path import model_file

    model_file(target)      # a missing file is refused before torch loads
    from ampaudit.loading import load_target

    chosen = _default_dtype(cfg)
    loaded = load_target(target, entry=entry, need_inputs=False)
    train_data, loss_fn = _hooks(loaded)
    if cfg.plan is not None or cfg.dtype == "float8":
        cfg.dtype = _apply_plan(loaded, cfg.plan, cfg.dtype, cfg.device, cfg.pad)
    if preflight_only:
        _preflight_only(loaded, train_data, cfg)
    trainer = _trainer(loaded, train_data, loss_fn, cfg)
    _say_start(trainer, cfg, chosen)
    result = _fit(trainer, cfg)
    _say_end(trainer, result, cfg)


def _preflight_only(loaded, train_data, cfg: TrainConfig) -> None:
    """``--preflight-only``: the precision preflight's lines, then exit 0, or 1 when a check failed."""
    from ampaudit.train.preflight import preflight_only as run_checks

    checks = run_checks(loaded.model, dtype=cfg.dtype, opt_level=cfg.opt_level, accum=cfg.accum, fsdp=cfg.fsdp,
                        fsdp_wrap=cfg.fsdp_wrap, reduce_dtype=cfg.reduce_dtype, device=cfg.device,
                        optimizer=loaded.hook("make_optimizer"), train_data=train_data)
    raise typer.Exit(1 if any(c.status == "fail" for c in checks) else 0)


# Flags whose config field is spelled otherwise, or whose value the field holds in another form. Every other flag
# but target, --entry, --config and --preflight-only is the field of its name (tests/test_train_config.py).
_FIELD_OF_FLAG = {"checkpoint": "checkpoint_dir", "clip_per_layer": "clip_mode", "fallback": "fp8_fallback"}


def _settings(ctx: typer.Context, flags: dict, path: Path | None) -> TrainConfig:
    """Defaults, then the file's settings, then the flags given on the command line (all of them without a file)."""
    from ampaudit.train.config import FIELDS, TrainConfig, load_train_config

    cfg = TrainConfig(dtype=None, progress=None)       # None: chosen for this device / terminal below
    if path is not None:
        cfg = load_train_config(path, cfg)
    given = {}
    for name, value in flags.items():
        # by name: typer carries a click of its own, whose ParameterSource is not click.core's
        if path is not None and getattr(ctx.get_parameter_source(name), "name", None) != "COMMANDLINE":
            continue
        if name == "clip_per_layer":
            value = "layer" if value else "norm"
        elif name == "fsdp_wrap" and value is not None:
            value = [c.strip() for c in value.split(",") if c.strip()] or None
        given[_FIELD_OF_FLAG.get(name, name)] = value
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if k in FIELDS})
    if cfg.progress is None:
        cfg.progress = sys.stderr.isatty()
    if cfg.fp8_fallback and cfg.plan_file is None:
        cfg.plan_file = cfg.plan         # a layer's switch is written back to the plan it trains
    return cfg


# --dtype's words (dtypes.NAMES' aliases of the training dtypes, and float8, which plans first), checked here
# so that a misspelt one is refused before torch loads; tests/test_cli_fast.py keeps the two in step.
DTYPE_WORDS = ("float16", "half", "fp16", "bfloat16", "bf16", "float32", "float", "fp32", "float8")


def _check(cfg: TrainConfig, preflight_only: bool) -> None:
    """Refuse a bad --dtype and flags that need another one, before the model file (and torch) is loaded."""
    if isinstance(cfg.dtype, str) and cfg.dtype.strip().lower().replace("torch.", "") not in DTYPE_WORDS:
        raise UsageError(f"unsupported training dtype {cfg.dtype!r}",
                         hint="use --dtype float16, bfloat16, float8 or float32")
    if (cfg.steps is None) == (cfg.epochs is None) and not preflight_only:
        raise UsageError("give --steps N or --epochs E", hint="e.g. ampaudit train model.py --steps 1000")
    if cfg.tensorboard is not None:
        if cfg.trace is None:
            raise UsageError("--tensorboard needs --trace FILE", hint="e.g. --trace run.jsonl --tensorboard runs/amp")
        writable_as("--tensorboard", cfg.tensorboard, folder=True)     # not found out when training ends
        from ampaudit.extras import require
        require("tensorboard", extra="tensorboard", feature="--tensorboard")
    if cfg.divergence_every is not None and cfg.trace is None:
        raise UsageError("--divergence-every needs --trace FILE", hint="e.g. --trace run.jsonl --divergence-every 500")
    if cfg.fp8_fallback and cfg.trace is None:
        raise UsageError("--fallback / --fp8-fallback needs --trace FILE",
                         hint="e.g. --plan plan.json --trace run.jsonl --fallback")
    if cfg.fp8_fallback and cfg.plan is None and cfg.dtype != "float8":
        raise UsageError("--fallback switches the layers of a low-precision plan", hint="add --plan plan.json")
    if cfg.pad and cfg.plan is None and cfg.dtype != "float8":
        raise UsageError("--pad pads the layers a float8 plan keeps out for alignment", hint="add --plan plan.json or --dtype float8")
    if cfg.pad and cfg.fsdp:
        raise UsageError("--pad is not supported with --fsdp", hint="drop --pad (those layers train in bf16), or train without --fsdp")
    if cfg.checkpoint_every is not None and cfg.checkpoint_dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint DIR", hint="e.g. --checkpoint ckpt")


def _default_dtype(cfg: TrainConfig) -> str | None:
    """Set the device's native dtype when none was chosen; the line that says so (None when it is no news)."""
    if cfg.dtype is not None:
        return None
    from ampaudit.machine.train_dtype import default_train_dtype

    cfg.dtype, why = default_train_dtype(cfg.device or _default_device())
    # the device's answer is news; the caller's own setting is not
    return None if why.startswith("set by") else f"dtype {cfg.dtype}: {why} (--dtype to choose)"


def _trainer(loaded, train_data, loss_fn, cfg: TrainConfig):
    from ampaudit.train.batchnorm import SmallBatchWarning
    from ampaudit.train.trainer import Trainer

    warnings.filterwarnings("ignore", category=SmallBatchWarning)   # printed below as one line instead
    return Trainer(loaded.model, loss_fn, train_data, config=cfg, optimizer=loaded.hook("make_optimizer"),
                   scheduler=loaded.hook("make_scheduler"), eval_data=loaded.hook("eval_data"),
                   metric_fn=loaded.hook("metric_fn"), meta={"target": loaded.display, "argv": sys.argv[1:]})


def _say_start(trainer, cfg: TrainConfig, chosen: str | None) -> None:
    """Rank 0's first lines: the chosen dtype, the preflight's verdicts, the warnings, resuming or not."""
    if not trainer.dist.is_main:
        return
    if chosen:
        typer.echo(chosen, err=True)
    from ampaudit.train.preflight_state import STATE_CHECKS

    for check in trainer.preflight:     # the verdicts, one line each (the state checks' warnings follow below)
        if not (check.status == "warn" and check.name in STATE_CHECKS):
            typer.echo(f"preflight {check.line()}", err=True)
    for message in trainer.warnings:        # rank 0's, said once at the start
        typer.echo(f"warning: {message}", err=True)
    if cfg.resume and cfg.checkpoint_dir is not None:
        typer.echo(f"resuming from {cfg.checkpoint_dir}" if trainer.has_checkpoint()
                   else f"no checkpoint in {cfg.checkpoint_dir}; starting fresh", err=True)


def _fit(trainer, cfg: TrainConfig):
    """Train, save the weights, and write TensorBoard logs from the trace (a halted run's too)."""
    main = trainer.dist.is_main
    try:
        with trainer:               # on leaving: every rank waits for the others, then the group is left
            result = trainer.fit(cfg.steps, epochs=cfg.epochs, resume=cfg.resume)
            if cfg.save is not None:
                state = trainer.full_state_dict()     # collective under FSDP
                if main:
                    _save_weights(state, cfg.save)
    except AmpAuditError as exc:
        if main:
            raise
        raise typer.Exit(exc.exit_code) from None   # rank 0 alone reports; the others exit with the same code
    finally:
        if cfg.tensorboard is not None and main and Path(cfg.trace).is_file():  # a halted run's is worth plotting
            from ampaudit.report.tensorboard import write_tensorboard
            from ampaudit.runtime.trace import read_trace
            count = write_tensorboard(read_trace(cfg.trace)[0], cfg.tensorboard)
            typer.echo(f"wrote {count} TensorBoard scalars to {cfg.tensorboard}", err=True)
    return result


def _say_end(trainer, result, cfg: TrainConfig) -> None:
    """Rank 0's summary; the exit code of a run a signal stopped (every rank)."""
    main = trainer.dist.is_main
    if main:
        scale = "off" if result.scale is None else f"{result.scale:g}"
        loss = "n/a" if result.loss is None else f"{result.loss:.6g}"
        typer.echo(f"trained {result.steps} steps ({result.skipped} skipped); loss {loss}; loss scale {scale}")
        if trainer.evaluator is not None and trainer.evaluator.results:
            from ampaudit.train.evaluate import describe_result
            typer.echo(describe_result(trainer.evaluator.results[-1]))
        if result.checkpoint is not None:
            typer.echo(f"checkpoint: {result.checkpoint}")
        if cfg.save is not None:
            typer.echo(f"weights: {cfg.save}")
    if result.stopped in ("SIGINT", "SIGTERM"):
        code = 130 if result.stopped == "SIGINT" else 143
        if main:
            typer.echo(f"stopped by {result.stopped} at step {result.steps}"
                       + ("; rerun with --resume to continue" if result.checkpoint else ""), err=True)
        raise typer.Exit(code)
