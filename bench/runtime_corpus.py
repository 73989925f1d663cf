"""Does the runtime stay quiet on healthy real models? ``ampaudit.watch`` + the report over the coverage corpus.

    .venv-bench/bin/python bench/runtime_corpus.py --families transformers             # 22 tiny HF configs
    .venv-bench/bin/python bench/runtime_corpus.py --families torchvision-cls --limit 20 --json rt.json
    .venv-bench/bin/python bench/runtime_corpus.py --models bert,gpt2 --families transformers --steps 5
    .venv-bench/bin/python bench/runtime_corpus.py --families torchvision-seg --batch 2     # BatchNorm in training mode

For each corpus model (bench/coverage_models.py: real torchvision, timm and transformers architectures, random
init, their own example inputs) the script trains it a few steps (``--steps``, default 3) the way a user's loop
under ``ampaudit.watch`` would: FP32 weights, CPU bf16 autocast, AdamW (lr 1e-4), the loss the mean of its float
outputs (bench/both_paths.py's), under ``ampaudit.watch(model, trace, every=1, divergence_every=1,
stats_every=1, precursors_every=1, dtype=torch.bfloat16)``, so every step runs the statistics, the precursors, the
FP32 shadow (own errors at every depth on the first check), the decision check and the swamping probe. Then it
builds ``ampaudit report``'s summary of the trace and counts what it warns about (recommendations at warning or
error), by kind: ``own_error`` (a keep_fp32 module whose evidence is its own error against FP32), ``range``
(keep_fp32 for headroom or values past the dtype's max), ``nonfinite`` (a first non-finite value, ``broken``,
``nonfinite_unlocated``), ``decisions``, ``precursors`` (and loss spikes), ``swamping``, ``other``. These models
train fine under AMP every day, so any warning is a candidate false alarm to look at.

Each model runs in its own process with a time limit (``--timeout``), like bench/accuracy.py's stages; one model
at a time (a loaded machine). Numbers go in BENCHMARKS.md ("Runtime on the corpus").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from both_paths import _alarms  # noqa: E402

KINDS = ("own_error", "range", "nonfinite", "decisions", "precursors", "swamping", "other")
# Recommendation kind -> the column it is counted in (keep_fp32 is split by its evidence, below).
_BY_REC = {"broken": "nonfinite", "nonfinite_unlocated": "nonfinite", "decision": "decisions",
           "precursor": "precursors", "loss_spike": "precursors", "swamping": "swamping", "preflight": "swamping",
           "state_overflow": "range"}
LR = 1e-4


def loss_of(out):
    """bench/both_paths.py's loss for a model without one: the sum of the means of its float outputs, in FP32."""
    from ampaudit.runtime.replay_state import float_tensors

    leaves = [t for t in float_tensors(out) if t.requires_grad]
    if not leaves:
        raise ValueError("the model's output has no floating tensor that requires grad")
    return sum(t.float().mean() for t in leaves)


def batched(value, batch: int):
    """``value`` (the example inputs, any nesting) with each tensor of leading size 1 made ``batch`` long: floating
    ones with fresh samples of the same mean and spread, others (token ids, masks) repeated. Training-mode
    BatchNorm needs more than one value per channel (DeepLab's pooled ASPP branch), and a one-sample batch's
    statistics make artifacts (an exact-zero mean) no real batch has."""
    import torch
    from torch.utils._pytree import tree_map

    def grow(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != 1 or batch <= 1:
            return t
        if not t.is_floating_point():
            return t.repeat(batch, *([1] * (t.dim() - 1)))
        g = torch.Generator().manual_seed(0)
        extra = torch.randn((batch - 1, *t.shape[1:]), generator=g, dtype=torch.float32)
        return torch.cat([t, (extra * t.float().std() + t.float().mean()).to(t.dtype)])
    return tree_map(grow, value)


def train_watched(model, args: tuple, kwargs: dict, trace: Path, steps: int) -> None:
    """``steps`` AdamW steps of ``model`` on its example inputs under CPU bf16 autocast, watched every step."""
    import torch

    import ampaudit

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with ampaudit.watch(model, trace=str(trace), every=1, divergence_every=1, stats_every=1, precursors_every=1,
                        dtype=torch.bfloat16):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(*args, **kwargs)
            loss_of(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def _keep_fp32_kind(evidence: str) -> str:
    if "non-finite" in evidence or " inf / " in evidence or "NaN" in evidence:
        return "nonfinite"
    if "rel_l2 " in evidence:
        return "own_error"
    return "range"


def count_warnings(summary: dict) -> dict:
    """The report's warnings at warning or error, by kind (see the module docstring), and each one in words:
    ``{"counts": {kind: n}, "warnings": [{"kind", "rec", "severity", "module", "what"}]}``."""
    counts = dict.fromkeys(KINDS, 0)
    found = []
    culprits = {c["module"]: c for c in (summary.get("divergence") or {}).get("culprits") or []}
    for rec in _alarms(summary):
        if rec["kind"] == "keep_fp32":
            for module, why in _keep_fp32_reasons(rec, culprits):
                kind = _keep_fp32_kind(why)
                counts[kind] += 1
                found.append({"kind": kind, "rec": "keep_fp32", "severity": rec["severity"], "module": module,
                              "what": why})
            continue
        kind = _BY_REC.get(rec["kind"], "other")
        counts[kind] += 1
        found.append({"kind": kind, "rec": rec["kind"], "severity": rec["severity"],
                      "module": ",".join(rec.get("modules") or []) or rec.get("module") or rec.get("signal"),
                      "what": rec.get("message", "")[:300]})
    first = summary.get("first_nonfinite")
    if first and not any(w["kind"] == "nonfinite" for w in found):
        counts["nonfinite"] += 1
        found.append({"kind": "nonfinite", "rec": "first_nonfinite", "severity": "error",
                      "module": first.get("module"), "what": json.dumps(first)[:300]})
    return {"counts": counts, "warnings": found}


def _g(value) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def _keep_fp32_reasons(rec: dict, culprits: dict) -> list[tuple[str, str]]:
    """(module, the first piece of evidence) per keep_fp32 module: an own-error culprit's verdict where it is one."""
    out = []
    for module in rec.get("modules") or []:
        c = culprits.get(module)
        if c is not None:
            words = "non-finite own output" if c["rule"] == "nonfinite" else f"own rel_l2 {_g(c['rel_l2'])}"
            out.append((module, f"{words} ({c['rule']}, line {_g(c['line'])}): {c['why']}"))
        else:
            listed = rec.get("message", "")
            at = listed.find(f"{module} (")
            out.append((module, listed[at + len(module) + 2:].split(")")[0] if at >= 0 else listed[:200]))
    return out


def run_one(spec: dict, steps: int, work: Path, batch: int = 1) -> dict:
    """Build, train under the watch and report one model in this process: a row with ``counts`` and ``warnings``
    (or ``error``)."""
    import torch

    from coverage_models import build
    from ampaudit.report.trace_summary import summarize_trace

    torch.set_num_threads(1)
    row = {"family": spec["family"], "model": spec["name"]}
    start = time.perf_counter()
    try:
        built = build(spec, "cpu")
        trace = work / f"{spec['family']}_{spec['name']}.jsonl".replace("/", "_")
        args, kwargs = batched((tuple(built.args), dict(built.kwargs)), batch)
        train_watched(built.model, args, kwargs, trace, steps)
        summary = summarize_trace(trace)
    except Exception as exc:  # noqa: BLE001 - a model that cannot run is a row with its reason
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row
    row.update(count_warnings(summary))
    div = summary.get("divergence") or {}
    # What ran, so a quiet row is known to have been checked: modules with own errors, decision sites, precursors.
    row["checked"] = {"scope": div.get("scope"), "modules": div.get("modules"),
                      "decision_sites": (summary.get("decisions") or {}).get("sites"),
                      "precursor_signals": len((summary.get("precursors") or {}).get("signals") or [])}
    row["culprits"] = (summary.get("divergence") or {}).get("culprits") or []
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run_isolated(spec: dict, steps: int, timeout: float, work: Path, batch: int = 1) -> dict:
    """``run_one`` in a child process, killed after ``timeout`` seconds."""
    out = work / "row.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", f"{spec['family']}:{spec['name']}",
           "--steps", str(steps), "--batch", str(batch), "--row", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"family": spec["family"], "model": spec["name"], "error": f"timeout after {timeout:g} s"}
    if not out.is_file():
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}, no row"])[-1]
        return {"family": spec["family"], "model": spec["name"], "error": tail[:300]}
    return json.loads(out.read_text())


def table(rows: list[dict]) -> list[dict]:
    """One line per family: models, ran, warnings by kind, models with any warning."""
    fams: dict[str, dict] = {}
    for r in rows:
        f = fams.setdefault(r["family"], {"family": r["family"], "models": 0, "ran": 0, "with_warnings": 0,
                                          **dict.fromkeys(KINDS, 0)})
        f["models"] += 1
        if "error" not in r:
            f["ran"] += 1
            f["with_warnings"] += bool(r["warnings"])
            for k in KINDS:
                f[k] += r["counts"][k]
    return list(fams.values())


def parse_args(argv):
    from coverage import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="transformers", help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--models", default=None, help="comma-separated model names within the families")
    p.add_argument("--limit", type=int, default=None, help="at most this many models per family")
    p.add_argument("--timm-count", type=int, default=160)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="grow inputs of batch 1 to this many samples (BatchNorm in "
                   "training mode needs more than one value per channel)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the table here")
    p.add_argument("--one", help=argparse.SUPPRESS)     # family:name, run in this process (the child)
    p.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        family, name = args.one.split(":", 1)
        with tempfile.TemporaryDirectory() as tmp:
            row = run_one({"family": family, "name": name}, args.steps, Path(tmp), args.batch)
        args.row.write_text(json.dumps(row))
        return 0
    from coverage import select

    specs = select(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(specs, 1):
            row = run_isolated(spec, args.steps, args.timeout, Path(tmp), args.batch)
            rows.append(row)
            words = row.get("error") or (", ".join(f"{w['kind']} {w['module']}" for w in row["warnings"]) or "quiet")
            print(f"[{i}/{len(specs)}] {row['family']}/{row['model']}: {words}"
                  + (f" ({row['seconds']} s)" if "seconds" in row else ""), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"rows": rows, "table": table(rows), "partial": True}, indent=1))
    print("\nfamily  models  ran  " + "  ".join(KINDS) + "  models with warnings")
    for f in table(rows):
        print(f"{f['family']}  {f['models']}  {f['ran']}  " + "  ".join(str(f[k]) for k in KINDS)
              + f"  {f['with_warnings']}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, "table": table(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
