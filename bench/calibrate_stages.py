"""What each of ``check --calibrate``'s own passes costs on one torchvision model, against one bare simulated
forward+backward of the same batch (random init, batch 2, cuda float16 simulated on the CPU, one thread).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/calibrate_stages.py swin_t --size 160
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/calibrate_stages.py transformers-all/regnet
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv-bench/bin/python bench/calibrate_stages.py timm:samvit_base_patch16 --size 256

A ``FAMILY/NAME`` of bench/coverage_models.py runs that corpus model on its own example inputs instead; ``timm:NAME``
a timm model built for ``--size`` (batch 1).

Prints seconds per stage: ``bare`` (the forward+backward under the simulation), ``locate`` (the inf/NaN locator's
replay, :func:`~ampaudit.runtime.locate.locate_nonfinite`), ``compare`` (each module against FP32,
:func:`~ampaudit.runtime.compare.compare_to_fp32`), ``decisions``
(:func:`~ampaudit.runtime.decision_record.measure_or_note`), and ``check`` (the whole
``ampaudit.check(..., calibrate=True)``, also as ``check_cpu``, this process's CPU seconds; ``--check-only`` runs
only it, ``--findings PATH`` writes its findings to diff two checkouts'). Compare two checkouts by alternating runs
with ``PYTHONPATH`` set to each:
the machine's load moves absolute seconds, so only side-by-side ratios mean anything.

``--memory`` runs each stage instead in a process of its own (the model built, no warm-up) and prints, per stage,
``<stage>_mb``, the peak resident memory (VmHWM, reset just before the stage: Linux's ``clear_refs``) less the
resident memory before it (``base_mb``: the model, its inputs, torch), and ``<stage>_cpu``, the CPU seconds of the
stage (cold: first-call costs included). CPU seconds and peaks, unlike wall seconds, do not move with the load of
other work on the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from coverage_tvops import import_torchvision  # noqa: E402


STAGES = ("bare", "locate", "compare", "decisions", "check")


def _passes(model, args, kwargs) -> dict:
    from ampaudit.analysis.calibrate import batch_loss
    from ampaudit.runtime.compare import compare_to_fp32
    from ampaudit.runtime.decision_record import measure_or_note
    from ampaudit.runtime.locate import locate_nonfinite

    loss = batch_loss(None, None)

    def bare():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(*args, **kwargs)
        total = loss(out)
        if total is not None:
            total.backward()
        model.zero_grad(set_to_none=True)

    return {"bare": bare,
            "locate": lambda: locate_nonfinite(model, args, kwargs, dtype=torch.float16, loss=loss),
            "compare": lambda: compare_to_fp32(model, args, kwargs, dtype=torch.float16),
            "decisions": lambda: measure_or_note(model, args, kwargs, dtype=torch.float16)}


def stages(name: str, size: int, findings: str | None = None, check_only: bool = False) -> dict[str, float]:
    import ampaudit
    from ampaudit.policy import Policy
    from ampaudit.simulate import target_autocast

    model, args, kwargs = _model(name, size)
    policy = Policy.load("cuda", "float16")
    passes = _passes(model, args, kwargs)
    bare = passes["bare"]
    with target_autocast(policy, "cpu", enter_autocast=False):
        bare()                                  # warm-up: first-call costs are no stage's
    out = {}
    for key, run in ({} if check_only else passes).items():
        with target_autocast(policy, "cpu", enter_autocast=False):
            start = time.perf_counter()
            run()
            out[key] = round(time.perf_counter() - start, 3)
    start, cpu = time.perf_counter(), time.process_time()
    report = ampaudit.check(model, *args, calibrate=True, **kwargs)
    out["check"] = round(time.perf_counter() - start, 3)
    out["check_cpu"] = round(time.process_time() - cpu, 3)
    if findings:               # to compare two checkouts' verdicts: the same file, diffed
        Path(findings).write_text(json.dumps([f.as_dict() for f in report.findings], indent=1, sort_keys=True))
    return out


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def one_stage(name: str, size: int, stage: str) -> dict[str, float]:
    """``stage`` alone, in this process: its CPU seconds and its peak resident memory above what was resident
    before it (the model and inputs built)."""
    import ampaudit
    from ampaudit.policy import Policy
    from ampaudit.simulate import target_autocast

    model, args, kwargs = _model(name, size)
    policy = Policy.load("cuda", "float16")
    reports = []
    run = (lambda: reports.append(ampaudit.check(model, *args, calibrate=True, **kwargs))) if stage == "check" \
        else _passes(model, args, kwargs)[stage]
    inner = _watch_check_parts() if stage == "check" else {}
    gc.collect()
    base = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")       # VmHWM := VmRSS, now
    cpu = time.process_time()
    with target_autocast(policy, "cpu", enter_autocast=False) if stage != "check" else contextlib.nullcontext():
        run()                                        # (check enters the target itself, as stages() runs it)
    cpu = time.process_time() - cpu
    peak = _status_mb("VmHWM")
    return {"base_mb": round(base), f"{stage}_mb": round(max(peak, *inner.values(), 0) - base),
            f"{stage}_cpu": round(cpu, 2), **{f"check.{k}_mb": round(v - base) for k, v in inner.items()},
            **{f"check.{k}_cpu": v for k, v in CPU.items()},
            **({"findings": len(reports[0].findings), "memory_notes": [n for n in reports[0].notes if "memory" in n]}
               if reports else {})}


# The parts of the whole check whose peaks --memory reports as ``check.<part>_mb`` (above the check's base): the
# module and the name the check calls each through.
_CHECK_PARTS = {"snapshot": ("ampaudit.api", "state_snapshot"), "capture": ("ampaudit.api", "capture_any"),
                "locate": ("ampaudit.runtime.locate", "locate_nonfinite"),
                "judge": ("ampaudit.runtime.locate", "judge_against_fp32"),
                "compare": ("ampaudit.runtime.compare", "compare_to_fp32"),
                "decisions": ("ampaudit.runtime.decision_record", "measure_or_note")}


CPU: dict[str, float] = {}      # the check's parts' CPU seconds, summed over their calls


def _watch_check_parts() -> dict[str, float]:
    """Wrap the check's parts so each records the highest resident MB while it ran (VmHWM reset at its start;
    a part run twice keeps the higher); returns the dict they fill."""
    import importlib

    peaks: dict[str, float] = {}

    def wrapped(part, real):
        def run(*a, **k):
            Path("/proc/self/clear_refs").write_text("5")
            cpu = time.process_time()
            try:
                return real(*a, **k)
            finally:
                peaks[part] = max(peaks.get(part, 0.0), _status_mb("VmHWM"))
                CPU[part] = round(CPU.get(part, 0.0) + time.process_time() - cpu, 2)
        return run

    for part, (module, attr) in _CHECK_PARTS.items():
        mod = importlib.import_module(module)
        setattr(mod, attr, wrapped(part, getattr(mod, attr)))
    return peaks


def memory(name: str, size: int) -> dict[str, float]:
    """Each stage in a child process of its own (:func:`one_stage`), one after another."""
    out: dict[str, float] = {}
    for stage in STAGES:
        done = subprocess.run([sys.executable, __file__, name, "--size", str(size), "--stage", stage],
                              capture_output=True, text=True, env=os.environ)
        if done.returncode:
            out[f"{stage}_mb"] = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        out.setdefault("base_mb", row.pop("base_mb"))
        out.update({k: v for k, v in row.items() if k not in ("model", "size", "base_mb")})
    return out


def _model(name: str, size: int) -> tuple[torch.nn.Module, tuple, dict]:
    if "/" in name:
        from coverage_models import build

        family, _, short = name.partition("/")
        import_torchvision()
        built = build({"family": family, "name": short}, "cpu")
        return built.model, tuple(built.args), dict(built.kwargs)
    tv = import_torchvision()[0]
    torch.manual_seed(0)
    if name.startswith("timm:"):    # a timm model at another image size (a large ViT's cost at a fraction of it)
        import timm

        model = timm.create_model(name[5:], pretrained=False, img_size=size)
        return model.eval(), (torch.randn(1, 3, size, size),), {}
    return getattr(tv.models, name)().eval(), (torch.randn(2, 3, size, size),), {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a torchvision.models builder name (resnet18, swin_t, ...) or FAMILY/NAME of a corpus model")
    p.add_argument("--size", type=int, default=160, help="input height and width of a torchvision name (default 160)")
    p.add_argument("--findings", metavar="PATH", help="also write the whole check's findings (JSON) here")
    p.add_argument("--check-only", action="store_true", help="time only the whole check, not each stage")
    p.add_argument("--memory", action="store_true",
                   help="each stage in a process of its own: peak resident MB above the model, and CPU seconds")
    p.add_argument("--stage", choices=STAGES, help="run only this stage, as --memory's child process does")
    p.add_argument("--leave-free-mib", type=float, metavar="MIB",
                   help="set [calibration] min_free_mib to the memory free now less MIB: the locator's memory guard "
                        "then stops its forward once this process took about MIB more (the guard on a real model)")
    args = p.parse_args(argv)
    if args.leave_free_mib is not None:
        from ampaudit.policy import settings
        from ampaudit.runtime.memory_guard import free_mib

        settings()["calibration"]["min_free_mib"] = free_mib() - args.leave_free_mib
    if args.stage:
        out = one_stage(args.model, args.size, args.stage)
    elif args.memory:
        out = memory(args.model, args.size)
    else:
        out = stages(args.model, args.size, args.findings, args.check_only)
    print(json.dumps({"model": args.model, "size": args.size, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
