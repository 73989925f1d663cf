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
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from coverage_tvops import import_torchvision  # noqa: E402


def stages(name: str, size: int, findings: str | None = None, check_only: bool = False) -> dict[str, float]:
    import ampaudit
    from ampaudit.analysis.calibrate import batch_loss
    from ampaudit.policy import Policy
    from ampaudit.runtime.compare import compare_to_fp32
    from ampaudit.runtime.decision_record import measure_or_note
    from ampaudit.runtime.locate import locate_nonfinite
    from ampaudit.simulate import target_autocast

    model, args, kwargs = _model(name, size)
    policy, loss = Policy.load("cuda", "float16"), batch_loss(None, None)

    def bare():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(*args, **kwargs)
        total = loss(out)
        if total is not None:
            total.backward()
        model.zero_grad(set_to_none=True)

    passes = {"bare": bare,
              "locate": lambda: locate_nonfinite(model, args, kwargs, dtype=torch.float16, loss=loss),
              "compare": lambda: compare_to_fp32(model, args, kwargs, dtype=torch.float16),
              "decisions": lambda: measure_or_note(model, args, kwargs, dtype=torch.float16)}
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
    args = p.parse_args(argv)
    out = stages(args.model, args.size, args.findings, args.check_only)
    print(json.dumps({"model": args.model, "size": args.size, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
