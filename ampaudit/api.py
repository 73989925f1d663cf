"""The library entry point of the static audit.

    report = ampaudit.check(model, x, device="cuda", dtype="float16")
    report = ampaudit.check(model, input_ids, attention_mask=mask, select=["AMP1"], rules_dirs=["my_rules"])

``check`` captures the model with torch.fx, propagates shapes and autocast dtypes on fake tensors (weights are
never read, so a meta-device model works), runs the rules and returns a :class:`~ampaudit.findings.Report`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ampaudit.analysis.amp_prop import AmpProp
from ampaudit.capture import Capture, capture_any
from ampaudit.errors import UsageError
from ampaudit.findings import Report
from ampaudit.policy import Policy
from ampaudit.rules.engine import relative_location, route_fixes, run_rules
from ampaudit.rules.loader import load_rules, rule_selected, validate_selectors
from ampaudit.rules.registry import MatchContext
from ampaudit.notes import collect
from ampaudit.quiet import quiet
from ampaudit.registry import Registry
from ampaudit.runtime.replay_state import state_snapshot


@dataclass
class Audit:
    """Everything one audit produced: the captured graph (nodes carry ``meta["amp"]``), the policy, the report.

    ``fix`` starts from here: each finding's ``node`` names the graph node it was found on.
    """

    capture: Capture
    policy: Policy
    report: Report
    opaque: list = dataclasses.field(default_factory=list)   # the wrapped functions not audited inside, and why
    recordable: list = dataclasses.field(default_factory=list)   # of those, what check records at these shapes


def check(model: nn.Module, *args, device: str = "cuda", dtype: str = "float16",
          select: Sequence[str] | None = None, ignore: Sequence[str] | None = None,
          rules_dirs: Sequence[str | Path] = (), target: str | None = None, base_dir: str | Path | None = None,
          capture_mode: str = "auto", calibrate: bool = False, batches: list | None = None,
          loss_fn=None, batch: int | None = None, data=None, opt_level: str = "O1", train_steps: int = 0,
          train_data=None, optimizer=None, scheduler=None, lr: float | None = None, **kwargs) -> Report:
    """Audit ``model`` called as ``model(*args, **kwargs)`` for the ``device``/``dtype`` autocast target.

    ``calibrate=True`` also runs the model (on ``batches`` of ``(args, kwargs)`` or ``(args, kwargs, target)``,
    else the example inputs) in FP32 and under the target's autocast, forward and backward (of
    ``loss_fn(output, target)`` where a batch has a target, else of the mean of the outputs), adding measured
    ``range``, ``nonfinite`` and ``divergence`` findings; the report's notes and ``calibration`` say which loss
    ran. ``data``: a :class:`~ampaudit.analysis.calibrate.CalibrationData` (``calibration_data(loaded)``, what
    the CLI passes) instead of ``batches`` and ``loss_fn``. ``batch``: the per-rank micro-batch the model will
    be trained with, which the BatchNorm rule (AMP304) judges.

    ``opt_level`` ("O1" or "O2", as ``ampaudit train --opt-level``): how the run stores the model. With
    ``calibrate=True``, the parameters and buffers a training-mode forward updates in place are measured in that
    storage (O2: cast to the target dtype, BatchNorm fp32, trainable parameters mastered; O1: as the model holds
    them), and updates that round away are findings (AMP801). ``train_steps=N`` also trains a copy N steps with
    the built-in Trainer (``train_data`` factory, ``loss_fn``, ``optimizer`` / ``scheduler`` factories and
    ``lr`` as ``ampaudit train`` takes them; without ``train_data``, the example inputs repeated and the mean of
    the outputs as the loss), in memory, and reports what its trace's report would warn about (AMP801-AMP804).
    A model that stores trainable fp16/bf16 weights at O1 (which the Trainer refuses: no FP32 master) trains
    as a plain loop steps them instead, the same meters watching (:mod:`ampaudit.train.probe_loop`).
    """
    return audit(model, *args, device=device, dtype=dtype, select=select, ignore=ignore, rules_dirs=rules_dirs,
                 target=target, base_dir=base_dir, capture_mode=capture_mode, calibrate=calibrate,
                 batches=batches, loss_fn=loss_fn, batch=batch, data=data, opt_level=opt_level,
                 train_steps=train_steps, train_data=train_data, optimizer=optimizer, scheduler=scheduler, lr=lr,
                 **kwargs).report


# What calibration learns by running the model as training will (--opt-level, --train-steps: the trainer's O2
# storage, the built-in Trainer, the report's verdicts), from ampaudit.train.probe, registered by decorator and
# loaded on first use: the trainer is a layer above this entry point's imports (it builds on planning, whose padding
# reuses rewrite, which audits through this module), so it plugs in as the rules' matchers do.
TRAINING: Registry = Registry("training measure", providers=("ampaudit.train.probe",))

# The families calibration measures (rules/calibration.toml); a calibrated report without one says so.
MEASURED_FAMILIES = frozenset({"nonfinite", "range", "divergence", "swamping", "precursor"})
_CAPTURE_NAMES = {"fx": "torch.fx", "export": "torch.export", "dispatch": "dispatch-level recording"}


def _capture_notes(mode: str, notes: list[str]) -> list[str]:
    # An earlier capture mode failing is routine (fx cannot trace data-dependent slicing): say once what ran, and
    # that it covers the whole model, then why each earlier choice did not, by the first sentence of its error
    # (the rest is torch's advice on rewriting the model: "consider using data-dependent friendly APIs ...").
    skipped, out = [], []
    for note in notes:
        name, sep, why = note.partition(": ")
        if sep and name in _CAPTURE_NAMES:
            skipped.append(f"{name} was not used: {_first_sentence(why)}")
        else:
            out.append(f"{_CAPTURE_NAMES[mode]}: {note}")
    if skipped:
        out.insert(0, f"audited the whole model through {_CAPTURE_NAMES[mode]} ({'; '.join(skipped)})")
    return out


def _first_sentence(text: str) -> str:
    for end in (". ", ".\n"):
        head, sep, _ = text.partition(end)
        if sep and len(head) >= 20:
            text = head
    return text.rstrip(".")


def audit(model: nn.Module, *args, device: str = "cuda", dtype: str = "float16",
          select: Sequence[str] | None = None, ignore: Sequence[str] | None = None,
          rules_dirs: Sequence[str | Path] = (), target: str | None = None, base_dir: str | Path | None = None,
          capture_mode: str = "auto", calibrate: bool = False, batches: list | None = None,
          loss_fn=None, batch: int | None = None, specialize: bool = True, data=None, opt_level: str = "O1",
          train_steps: int = 0, train_data=None, optimizer=None, scheduler=None, lr: float | None = None,
          **kwargs) -> Audit:
    """Like :func:`check`, but also returns the captured, propagated graph and the policy.

    ``specialize=False`` leaves a torch.fx.wrap'd function opaque where its body can only be recorded at the
    example inputs' shapes (what ``fix`` rewrites must hold for every input), rather than splicing that path in.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"check() needs an nn.Module, got {type(model).__name__}", hint="pass the model first")
    policy = Policy.load(device, dtype)
    opt_level = _training_options(opt_level, train_steps, calibrate)
    rules = load_rules(list(rules_dirs))
    validate_selectors(rules, list(select or []), "--select")
    validate_selectors(rules, list(ignore or []), "--ignore")
    active = [r for r in rules if rule_selected(r, list(select or []), list(ignore or []))]

    # Capturing runs the user's forward (fx's tracing and shape pass, export's, dispatch's recording) and
    # calibration runs it again: a module in training mode moves BatchNorm's running statistics, an EMA teacher
    # updated in forward moves its weights, dropout draws from the global RNG. An audit changes nothing the user
    # has: parameters, buffers, modes, requires_grad and the RNGs are put back as they were, whatever ran.
    restore = state_snapshot(model)
    try:
        with cyclic_gc_paused(not calibrate):
            cap = capture_any(model, args, kwargs, mode=capture_mode, policy=policy)
            prop = AmpProp(cap.gm, policy, specialize=specialize)
            g_args, g_kwargs = cap.graph_inputs(args, kwargs)
            with quiet():                  # fake kernels (torchvision's) warn while shapes propagate
                prop.propagate(*g_args, **g_kwargs)
        if calibrate:
            # Calibration measures the model the user gave, not one capture moved. Without it the `finally`
            # below is the one restore (each one reads every weight and its copy).
            restore()
        _require_tensor_output(cap)
        ctx = MatchContext(gm=cap.gm, root=cap.root, policy=policy, batch=batch)
        skipped: list[str] = []
        if calibrate:
            # What a statistic or the simulation had to skip is said in the report, not raised.
            with collect() as skipped, quiet():
                data = data or _data(args, kwargs, batches, loss_fn, train_data, optimizer, scheduler)
                ctx.calibration = _calibrate(model, data, policy)
                skipped.extend(TRAINING.load()["calibrate"](ctx.calibration, model, data, policy,
                                                            opt_level=opt_level, steps=train_steps, lr=lr,
                                                            example=(args, kwargs)))
    finally:
        restore()
    findings, suppressed = run_rules(ctx, active)
    route_fixes(findings, cap.mode, cap.gm)
    if base_dir is not None:
        for f in findings:
            relative_location(f, Path(base_dir))
    report = Report(target=target or type(model).__name__, capture=cap.mode, policy=policy.describe(),
                    findings=findings, suppressed=suppressed, nodes=len(cap.gm.graph.nodes))
    if ctx.calibration is not None:
        _calibration_notes(report, ctx.calibration, data, skipped, device)
    report.notes.extend(_capture_notes(cap.mode, list(cap.notes)))
    report.notes.extend(prop.notes)
    report.unaudited.extend(prop.notes)
    if prop.unknown:
        names = ", ".join(n.name for n in prop.unknown[:5])
        report.notes.append(f"shapes unknown after {len(prop.unknown)} node(s) without a fake kernel ({names}); "
                            "alignment and depth findings there may be missing")
        report.unaudited.append(report.notes[-1])
    return Audit(capture=cap, policy=policy, report=report, opaque=list(prop.notes),
                 recordable=list(prop.recordable))


def _calibration_notes(report: Report, cal, data, skipped: list[str], device: str) -> None:
    """What calibration measured, on what, and what it had to skip, as the report's notes."""
    sim = "" if device == "cpu" else f"; {device} policy simulated on CPU"
    measured = [f for f in report.findings if f.family in MEASURED_FAMILIES]
    clean = "" if measured else (": no measured faults (no inf/NaN, range, divergence, flipped decision or "
                                 "update that rounds away)")
    if clean and skipped:       # a measurement that was skipped found nothing because it did not run
        clean += " in what was measured (the notes below say what was not)"
    report.notes.append(f"calibrated on {cal.batches} batch(es){sim}{clean}")
    report.notes.append(f"backward: {cal.backward}")
    if data.note:
        report.notes.append(data.note)
    report.notes.extend(skipped)
    report.calibration = {"batches": cal.batches, "origin": data.origin, "backward": cal.backward}


@contextlib.contextmanager
def cyclic_gc_paused(pause: bool = True):
    """``with cyclic_gc_paused():`` Python's cyclic garbage collector does not run inside (reference counting
    still frees what it always frees), and runs again after it, as it was. A capture and its shape propagation
    make hundreds of thousands of short-lived objects: that many allocations start collections, and one of them
    a full one, which walks every object the process holds (torch's, timm's, transformers': 0.17-0.19 CPU s for
    mobilevit_xxs, a tenth of its check, bench/capture_speed.py). What they leave in cycles (traced graphs, fake
    tensors) waits for the collector's next run after it; the calibration, which runs the real forward many
    times, keeps the collector (``pause=False``)."""
    stop = pause and gc.isenabled()
    if stop:
        gc.disable()
    try:
        yield
    finally:
        if stop:
            gc.enable()


def _data(args: tuple, kwargs: dict, batches: list | None, loss_fn, train_data=None, optimizer=None,
          scheduler=None):
    from ampaudit.analysis.calibrate import CalibrationData

    train = {"train_data": train_data, "optimizer": optimizer, "scheduler": scheduler}
    if batches:
        return CalibrationData(list(batches), loss_fn, "the given batches", **train)
    return CalibrationData([(args, kwargs)], loss_fn, "the example inputs", **train)


def _training_options(opt_level: str, train_steps: int, calibrate: bool) -> str:
    """The normalised opt level; a UsageError for a bad one, a negative ``train_steps``, or either without
    calibration."""
    level = "O1" if opt_level == "O1" else TRAINING.load()["opt_level"](opt_level)
    if isinstance(train_steps, bool) or not isinstance(train_steps, int) or train_steps < 0:
        raise UsageError(f"train_steps must be a whole number >= 0, got {train_steps!r}",
                         hint="e.g. --train-steps 34 (0: no training steps)")
    if (train_steps or level != "O1") and not calibrate:
        what = "--train-steps" if train_steps else "--opt-level O2"
        raise UsageError(f"{what} needs --calibrate (calibrate=True)", hint="add --calibrate")
    return level


def _calibrate(model: nn.Module, data, policy: Policy):
    from ampaudit.analysis.calibrate import calibrate

    if any(t.is_meta for t in model.parameters()):
        raise UsageError("--calibrate runs the model, but its weights are on the meta device",
                         hint="build the model with real weights, or drop --calibrate for the static audit")
    return calibrate(model, data.batches, policy, loss_fn=data.loss_fn, origin=data.origin)


def _require_tensor_output(cap: Capture) -> None:
    """A forward must return tensors (or containers of them): nothing else can be checked or trained."""
    from torch.utils._pytree import tree_flatten

    from ampaudit.analysis.amp_prop import AMP_KEY
    from ampaudit.errors import InputError

    out = next((n for n in cap.gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return
    leaves = [a for a in tree_flatten(out.args)[0]]
    nodes = [a for a in leaves if hasattr(a, "meta")]
    if not nodes and leaves:
        kinds = sorted({type(a).__name__ for a in leaves})
        raise InputError(f"the forward returns {', '.join(kinds)}, not tensors",
                         hint="return the model's output tensor(s) from forward")
    def holds_tensors(n) -> bool:          # a dataclass of tensors (fx records its construction as one node)
        value = n.meta[AMP_KEY].value
        return dataclasses.is_dataclass(value) and any(
            isinstance(getattr(value, f.name, None), torch.Tensor) for f in dataclasses.fields(value))

    if nodes and all(AMP_KEY in n.meta and n.meta[AMP_KEY].shape is None and n.meta[AMP_KEY].error is None
                     and n.op != "placeholder" and not holds_tensors(n) for n in nodes):
        raise InputError("the forward returns no tensors", hint="return the model's output tensor(s) from forward")
