"""``ampaudit train``: train a model file under mixed precision with the loss-scale policy, clipping,
accumulation, master weights, checkpoints and an optional trace.

    ampaudit train model.py --steps 1000 --dtype float16 --accum 4 --clip-norm 1.0 \\
        --checkpoint ckpt --checkpoint-every 100 --trace run.jsonl --save final.pt
    torchrun --nproc-per-node 2 -m ampaudit train model.py --steps 1000 --accum 2
    torchrun --nproc-per-node 2 -m ampaudit train model.py --steps 1000 --fsdp --dtype bfloat16 --checkpoint ckpt
    torchrun --nproc-per-node 2 -m ampaudit train model.py --fsdp --preflight-only

The model file provides ``train_data()`` and ``loss_fn(output, target)`` (and optionally ``make_optimizer(params)``,
``make_scheduler(optimizer)``, and for ``--eval-every`` ``eval_data()`` and ``metric_fn(output, target) -> dict``).
Exit codes: 0 done, 2 error, 3 halted by the loss scaler, 128+N on signal N; ``--preflight-only``: 0 when every check
passes, 1 when one fails.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from ampaudit.cli.app import app, cli_errors
from ampaudit.errors import AmpAuditError, TrainError, UsageError
from ampaudit.fileio import atomic_write


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
    from ampaudit.planning.apply import apply_plan, load_plan

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
    target = device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = apply_plan(loaded.model, data, device=target, pad=pad)
    padded = chosen.get("padded") or {}
    from collections import Counter

    from ampaudit.planning.convert import emulation_notes, recipes_of
    from ampaudit.planning.recipes import HIGH_PRECISION, recipe

    other = Counter(r["choice"] for r in recipes_of(loaded.model).values()
                    if r["choice"] not in HIGH_PRECISION and recipe(r["choice"]).family != "float8")
    typer.echo(f"plan: {len(chosen['float8'])} float8 layer(s)"
               + (f" ({len(padded)} padded: {'; '.join(c.describe() for c in padded.values())})" if padded else "")
               + "".join(f", {n} {name}" for name, n in other.items())
               + f", {len(chosen['float32'])} float32, the rest bf16", err=True)
    for note in emulation_notes(loaded.model):
        typer.echo(note, err=True)
    return "bfloat16"


def _save_weights(state: dict, path: Path) -> None:
    atomic_write(path, lambda fh: torch.save(state, fh))


@app.command()
@cli_errors
def train(
    target: Annotated[str, typer.Argument(help="Model file (model.py) or pkg.module:factory.")],
    *,
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
    from ampaudit.loading import load_target
    from ampaudit.train.trainer import Trainer

    if (steps is None) == (epochs is None) and not preflight_only:
        raise UsageError("give --steps N or --epochs E", hint="e.g. ampaudit train model.py --steps 1000")
    if tensorboard is not None:
        if trace is None:
            raise UsageError("--tensorboard needs --trace FILE", hint="e.g. --trace run.jsonl --tensorboard runs/amp")
        from ampaudit.integrations import require
        require("tensorboard", extra="tensorboard", feature="--tensorboard")
    if divergence_every is not None and trace is None:
        raise UsageError("--divergence-every needs --trace FILE", hint="e.g. --trace run.jsonl --divergence-every 500")
    if fallback and trace is None:
        raise UsageError("--fallback / --fp8-fallback needs --trace FILE",
                         hint="e.g. --plan plan.json --trace run.jsonl --fallback")
    if fallback and plan is None and dtype != "float8":
        raise UsageError("--fallback switches the layers of a low-precision plan", hint="add --plan plan.json")
    if pad and plan is None and dtype != "float8":
        raise UsageError("--pad pads the layers a float8 plan keeps out for alignment", hint="add --plan plan.json or --dtype float8")
    if pad and fsdp:
        raise UsageError("--pad is not supported with --fsdp", hint="drop --pad (those layers train in bf16), or train without --fsdp")
    if checkpoint_every is not None and checkpoint is None:
        raise UsageError("--checkpoint-every needs --checkpoint DIR", hint="e.g. --checkpoint ckpt")
    chosen = None
    if dtype is None:
        from ampaudit.machine.train_dtype import default_train_dtype

        dtype, why = default_train_dtype(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not why.startswith("set by"):    # the device's answer is news; the caller's own setting is not
            chosen = f"dtype {dtype}: {why} (--dtype to choose)"
    loaded = load_target(target, entry=entry, need_inputs=False)
    train_data, loss_fn = _hooks(loaded)
    if plan is not None or dtype == "float8":
        dtype = _apply_plan(loaded, plan, dtype, device, pad)
    make_scheduler = loaded.hook("make_scheduler")
    wrap = [c.strip() for c in fsdp_wrap.split(",") if c.strip()] if fsdp_wrap else None
    if preflight_only:
        from ampaudit.train.preflight import preflight_only as run_checks

        checks = run_checks(loaded.model, dtype=dtype, opt_level=opt_level, accum=accum, fsdp=fsdp, fsdp_wrap=wrap,
                            reduce_dtype=reduce_dtype, device=device, optimizer=loaded.hook("make_optimizer"),
                            train_data=train_data)
        raise typer.Exit(1 if any(c.status == "fail" for c in checks) else 0)
    from ampaudit.train.batchnorm import SmallBatchWarning
    warnings.filterwarnings("ignore", category=SmallBatchWarning)   # printed below as one line instead
    trainer = Trainer(
        loaded.model, loss_fn, train_data, optimizer=loaded.hook("make_optimizer"), scheduler=make_scheduler,
        lr=lr, dtype=dtype, opt_level=opt_level, accum=accum, clip_norm=clip_norm, clip_value=clip_value,
        clip_mode="layer" if clip_per_layer else "norm", loss_scale=loss_scale,
        max_consecutive_skips=max_consecutive_skips, device=device, trace=trace, trace_every=trace_every,
        divergence_every=divergence_every, fp8_fallback=fallback, plan_file=plan if fallback else None,
        checkpoint_dir=checkpoint, checkpoint_every=checkpoint_every, fsdp=fsdp, reduce_dtype=reduce_dtype,
        fsdp_wrap=wrap,
        compile=compile,
        progress=sys.stderr.isatty() if progress is None else progress,
        scaler_options={"init_scale": init_scale, "growth_interval": growth_interval, "hysteresis": hysteresis,
                        "min_scale": min_scale, "max_scale": max_scale, "skip_window": skip_window,
                        "max_skip_fraction": max_skip_fraction},
        warmup_steps=warmup_steps, scale_lr=scale_lr, base_batch=base_batch,
        eval_data=loaded.hook("eval_data"), eval_every=eval_every, metric_fn=loaded.hook("metric_fn"),
        checkpoint_activations=checkpoint_activations, sync_bn=sync_bn,
        meta={"target": loaded.display, "argv": sys.argv[1:]})
    main = trainer.dist.is_main
    if chosen and main:
        typer.echo(chosen, err=True)
    if main:                                # the preflight's verdicts, one line each (its warnings follow below)
        from ampaudit.train.preflight_state import STATE_CHECKS

        for check in trainer.preflight:
            if not (check.status == "warn" and check.name in STATE_CHECKS):
                typer.echo(f"preflight {check.line()}", err=True)
    for message in trainer.warnings:        # rank 0's, said once at the start
        typer.echo(f"warning: {message}", err=True)
    if resume and main and checkpoint is not None:
        typer.echo(f"resuming from {checkpoint}" if trainer.has_checkpoint()
                   else f"no checkpoint in {checkpoint}; starting fresh", err=True)
    try:
        with trainer:               # on leaving: every rank waits for the others, then the group is left
            result = trainer.fit(steps, epochs=epochs, resume=resume)
            if save is not None:
                state = trainer.full_state_dict()     # collective under FSDP
                if main:
                    _save_weights(state, save)
    except AmpAuditError as exc:
        if main:
            raise
        raise typer.Exit(exc.exit_code) from None   # rank 0 alone reports; the others exit with the same code
    finally:
        if tensorboard is not None and main and trace.is_file():  # a halted run's trace is worth plotting too
            from ampaudit.integrations.tensorboard import write_tensorboard
            from ampaudit.runtime.trace import read_trace
            count = write_tensorboard(read_trace(trace)[0], tensorboard)
            typer.echo(f"wrote {count} TensorBoard scalars to {tensorboard}", err=True)
    if main:
        scale = "off" if result.scale is None else f"{result.scale:g}"
        loss = "n/a" if result.loss is None else f"{result.loss:.6g}"
        typer.echo(f"trained {result.steps} steps ({result.skipped} skipped); loss {loss}; loss scale {scale}")
        if trainer.evaluator is not None and trainer.evaluator.results:
            from ampaudit.train.evaluate import describe_result
            typer.echo(describe_result(trainer.evaluator.results[-1]))
        if result.checkpoint is not None:
            typer.echo(f"checkpoint: {result.checkpoint}")
        if save is not None:
            typer.echo(f"weights: {save}")
    if result.stopped in ("SIGINT", "SIGTERM"):
        code = 130 if result.stopped == "SIGINT" else 143
        if main:
            typer.echo(f"stopped by {result.stopped} at step {result.steps}"
                       + ("; rerun with --resume to continue" if result.checkpoint else ""), err=True)
        raise typer.Exit(code)
