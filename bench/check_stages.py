"""Where one `ampaudit check` spends its CPU time beside the bare export, in one process, per stage.

    python bench/check_stages.py --family transformers-all --models qwen3_5 janus llama vit --repeat 2
    python bench/check_stages.py --family transformers-all --models janus --threads 2   # as coverage.py's worker

For each model (built as bench/capture_speed.py builds it: the first device whose eager forward runs) it times, in
CPU seconds (``time.process_time``) and ``--repeat`` times over: a bare ``torch.export.export(strict=False)``,
then ``ampaudit.check``, with check's stages timed by wrappers around them: the state snapshot and its restores
(``same_bits``: the weights compared with their copies), the fx attempt, the export under the target's autocast,
``ep.module()``, whole-graph code generations (``recompile``, also those inside torch.export), the propagation and
the rules. The first repetition pays each first call's cost (the fake-tensor cache, lazily imported kernels): a
check process pays it once, after its build; bench/capture_speed.py measures that whole process.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _timer(totals: dict, obj, attr: str, key: str) -> None:
    real = getattr(obj, attr)

    @functools.wraps(real)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            totals[key] += time.process_time() - start
    setattr(obj, attr, timed)


def instrument() -> dict:
    """Wrap check's stages; returns the dict each wrapper adds its CPU seconds to."""
    import torch.export.exported_program as exported_program
    import torch.fx as fx

    import ampaudit.api as api
    import ampaudit.capture as capture
    import ampaudit.capture.export_capture as export_capture
    import ampaudit.runtime.replay_state as replay_state
    from ampaudit.analysis.amp_prop import AmpProp

    totals: dict = collections.defaultdict(float)
    for obj, attr, key in ((api, "state_snapshot", "snapshot"), (replay_state, "_same_bits", "same_bits"),
                           (capture, "capture", "fx"), (export_capture, "_export", "export"),
                           (exported_program.ExportedProgram, "module", "ep.module"),
                           (fx.GraphModule, "recompile", "recompile"), (AmpProp, "propagate", "propagate"),
                           (api, "run_rules", "rules")):
        _timer(totals, obj, attr, key)
    return totals


def measure(family: str, name: str, repeat: int) -> list[dict]:
    import torch

    import ampaudit
    from capture_speed import _built
    from coverage_runner import _quiet

    totals = instrument()
    with _quiet():
        built = _built({"family": family, "name": name}, None)
    rows = []
    for _ in range(repeat):
        totals.clear()
        with _quiet():
            start = time.process_time()
            torch.export.export(built.model, tuple(built.args), dict(built.kwargs), strict=False)
            bare = time.process_time() - start
            totals.clear()
            start = time.process_time()
            report = ampaudit.check(built.model, *built.args, **built.kwargs)
            check = time.process_time() - start
        rows.append({"model": name, "device": built.device, "capture": report.capture, "nodes": report.nodes,
                     "bare_export": round(bare, 3), "check": round(check, 3), "ratio": round(check / bare, 2),
                     **{k: round(v, 3) for k, v in sorted(totals.items())}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="transformers-all")
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (coverage.py's worker: cores/workers)")
    args = parser.parse_args(argv)
    import torch

    from capture_speed import _import_libraries

    torch.set_num_threads(args.threads)
    _import_libraries(args.family)
    for name in args.models:
        for row in measure(args.family, name, args.repeat):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
