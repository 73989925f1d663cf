"""Does the runtime see what calibrate sees? Every planted model through both paths, side by side.

    python bench/both_paths.py                      # every planted model with a culprit, both paths
    python bench/both_paths.py --only moe_router_bf16,gelu_cube --json both.json
    python bench/both_paths.py --only ema_teacher_bf16,running_mean_buffer,attn_logit_growth,ema_teacher_fp32

For each planted model (../shared/planted and tests/planted, the module named in its ``EXPECT``):
- ``check --calibrate`` on its own target (``ampaudit.check(..., calibrate=True)``; a training fault with its
  ``EXPECT`` ``opt_level`` and ``train_steps=34``, like ``check --calibrate --opt-level O2 --train-steps 34``):
  named when a finding at warning or above is on the culprit (or a module inside it), as bench/accuracy.py
  counts;
- ``ampaudit train FILE --trace T --divergence-every 1`` then ``ampaudit report T --json``: named when the report
  points at the culprit: the first non-finite value's module, the top own-error culprit, or a recommendation
  (decisions, swamping, precursors, keep_fp32) listing it. Training faults (``"phase": "training"``: state that
  loses its updates, logits that grow) run their ``EXPECT`` options (``opt_level``) for 34 steps; the others 2.
  A fault of the half model (``"fails_in": "half model (O2)"``: a BatchNorm buffer past fp16's range), which
  ``ampaudit train`` cannot show (its O2 keeps BatchNorm fp32), runs instead as a user's loop would:
  ``model.half()`` under ``ampaudit.watch`` for ``WATCH_STEPS`` steps of the file's train_data/loss_fn. Weights the
  file stores in bf16 with no FP32 master (``"fails_in": "user loop"``: pure-bf16 training), which ``ampaudit train``
  refuses at O1 and masters at O2, run as the user's loop steps them: the file's optimizer under autocast, watched,
  for 34 steps (the healthy twin, float32 weights, through ``ampaudit train`` as usual).

The healthy twins (``ema_teacher_fp32``, ``attn_logit_growth`` with ``--entry build_qknorm_model`` and with ``--lr
0.02``; a forward fault's fixed version, its file's ``build_fixed_model``) run both paths too: a training twin must
raise no swamping or precursor warning, a forward twin nothing at warning or above on the culprit and no non-finite
value (calibrate), and a report that neither points at the culprit nor finds a first non-finite value (train+report).

A model without ``train_data``/``loss_fn`` trains on its example inputs with the mean of its outputs as the loss
(a wrapper file written next to the trace). Prints one row per model and the share each path names; ``--json``
keeps the rows. Numbers go in BENCHMARKS.md ("Both paths").
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import _load, located, planted_files  # noqa: E402

TRAINING_STEPS = 34     # training faults, both paths: attn_logit_growth crosses at 17 and breaks from ~29
# The healthy twins of the training faults (model, what differs) and the report's warnings a twin must not raise.
TWINS = (("ema_teacher_fp32", {}), ("attn_logit_growth", {"entry": "build_qknorm_model"}),
         ("attn_logit_growth", {"lr": 0.02}), ("t5_ff_wo_fp16", {"entry": "build_fixed_model"}),
         ("rmsnorm_square_fp16", {"entry": "build_fixed_model"}),
         ("attention_pool_exp_fp16", {"entry": "build_fixed_model"}),
         ("vq_codebook_bf16", {"entry": "build_fixed_model"}),
         ("pure_bf16_adamw", {"entry": "build_fixed_model"}),
         ("gated_recurrence_bf16", {"entry": "build_fixed_model"}))
TRAINING_ALARMS = ("swamping", "preflight", "precursor")
HALF_MODEL = "half model (O2)"      # EXPECT["fails_in"] of a fault only the half model shows
USER_LOOP = "user loop"             # EXPECT["fails_in"] of weights stored in fp16/bf16, which ampaudit train refuses
WATCH_STEPS = 3

# A user's loop, every step sampled, on the file's train_data and loss_fn. ``half``: on the half model
# (model.half(), half inputs, SGD); a dtype name: on the model as the file stores it (bf16 weights, no FP32
# master), the file's optimizer, under that autocast.
_WATCH_LOOP = '''import itertools, runpy, sys, torch
from torch.utils._pytree import tree_map
import ampaudit
m = runpy.run_path(sys.argv[1])
half = sys.argv[4] == "half"
model = (m["build_model"]().half() if half else m["build_model"]()).train()
opt = torch.optim.SGD(model.parameters(), lr=1e-3) if half else m["make_optimizer"](model.parameters())
cast = lambda t: t.half() if half and torch.is_tensor(t) and t.is_floating_point() else t
with ampaudit.watch(model, sys.argv[2], every=1) as w:
    for inputs, target in itertools.islice(m["train_data"](), int(sys.argv[3])):
        inputs = tree_map(cast, inputs if isinstance(inputs, (tuple, list, dict)) else (inputs,))
        with torch.autocast("cpu", dtype=getattr(torch, sys.argv[4]), enabled=not half):
            out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        m["loss_fn"](out, target).backward()
        opt.step(); opt.zero_grad()
'''

_WRAPPER = '''import itertools, runpy, torch
_m = runpy.run_path({path!r})
globals().update({{k: v for k, v in _m.items() if not k.startswith("__")}})
if "train_data" not in _m:
    def train_data():
        inputs = _m["example_inputs"]()
        return itertools.repeat((inputs, None))
if "loss_fn" not in _m:
    def loss_fn(out, target):
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t)]
        return sum(t.float().mean() for t in outs)
'''


def _culprits(expect: dict) -> list[str]:
    return list(expect.get("culprits") or [expect["culprit"]])


def _names(module: str | None, culprits: list[str]) -> bool:
    if not isinstance(module, str):
        return False
    return any(module == c or module.startswith(c + ".") or fnmatch.fnmatch(module, c) for c in culprits)


def _alarms(summary: dict) -> list[dict]:
    """The report's recommendations at warning or above (an info, such as massive activations in a run without
    fp8 layers, neither names a culprit nor breaks a twin's quiet), as check's findings are counted."""
    return [r for r in summary.get("recommendations", []) if r.get("severity", "warning") in ("warning", "error")]


def report_names(summary: dict, culprits: list[str]) -> str | None:
    """Where the report names one of ``culprits`` (a word for the table), or None."""
    first = summary.get("first_nonfinite") or {}
    if _names(first.get("module"), culprits):
        return "first non-finite"
    top = (summary.get("divergence") or {}).get("culprits") or []
    if top and _names(top[0].get("module"), culprits):
        return "top own error"
    for rec in _alarms(summary):
        if any(_names(m, culprits) for m in rec.get("modules") or []):
            return rec["kind"]
    return None


def run_trace(path: Path, expect: dict, work: Path, twin: dict | None = None) -> dict:
    """Train and report one model: ``runtime_by`` (where the report names the culprit), or for a ``twin``
    (``{"entry": ..., "lr": ...}``, a healthy variant) ``runtime_alarms``, the training warnings it raised."""
    mod = _load(path)
    target = expect.get("target", {"device": "cpu", "dtype": "float16"})
    model_file = path
    if not (hasattr(mod, "train_data") and hasattr(mod, "loss_fn")):
        model_file = work / f"{path.stem}_train.py"
        model_file.write_text(_WRAPPER.format(path=str(path)))
    training = expect.get("phase") == "training"
    trace = work / f"{path.stem}{'_twin' + str(abs(hash(str(twin)))) if twin else ''}.jsonl"
    cmd = [sys.executable, "-m", "ampaudit", "train", str(model_file),
           "--steps", str(TRAINING_STEPS) if training else "2",
           "--device", "cpu", "--dtype", target["dtype"], "--trace", str(trace), "--divergence-every", "1"]
    if expect.get("opt_level"):
        cmd[cmd.index("--divergence-every"):cmd.index("--divergence-every") + 2] = ["--opt-level", expect["opt_level"],
                                                                                   "--trace-every", "10"]
    for key in ("entry", "lr"):
        if (twin or {}).get(key) is not None:
            cmd += [f"--{key}", str(twin[key])]
    if expect.get("fails_in") == HALF_MODEL:
        cmd = [sys.executable, "-c", _WATCH_LOOP, str(model_file), str(trace), str(WATCH_STEPS), "half"]
    elif expect.get("fails_in") == USER_LOOP and twin is None:
        cmd = [sys.executable, "-c", _WATCH_LOOP, str(model_file), str(trace), str(TRAINING_STEPS), target["dtype"]]
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    row = {"train_rc": run.returncode}
    if not trace.is_file():
        row["runtime_error"] = (run.stderr.strip().splitlines() or ["no trace written"])[-1][:200]
        return row
    rep = subprocess.run([sys.executable, "-m", "ampaudit", "report", str(trace), "--json"], capture_output=True,
                         text=True, env=env, timeout=300)
    try:
        summary = json.loads(rep.stdout)
    except json.JSONDecodeError:
        row["runtime_error"] = (rep.stderr.strip().splitlines() or ["report failed"])[-1][:200]
        return row
    if twin is not None and training:
        row["runtime_alarms"] = sorted({r["kind"] for r in _alarms(summary) if r.get("kind") in TRAINING_ALARMS})
    elif twin is not None:      # a forward fault's fixed version: the report must not point at the culprit
        named = report_names(summary, _culprits(expect))
        row["runtime_alarms"] = sorted({named} if named else set()) + (
            ["first non-finite"] if summary.get("first_nonfinite") and named != "first non-finite" else [])
    else:
        row["runtime_by"] = report_names(summary, _culprits(expect))
    return row


def training_options(mod, expect: dict, twin: dict | None = None) -> dict:
    """What ``check --calibrate`` is given for a training fault, the way ``run_trace`` trains it: the ``EXPECT``
    opt level and the same 34 steps, on the model file's train_data/loss_fn/make_optimizer/make_scheduler (and a
    twin's ``lr``)."""
    if expect.get("phase") != "training":
        return {}
    hooks = {"train_data": "train_data", "loss_fn": "loss_fn", "optimizer": "make_optimizer",
             "scheduler": "make_scheduler"}
    return {"opt_level": expect.get("opt_level", "O1"), "train_steps": TRAINING_STEPS,
            **{k: getattr(mod, name) for k, name in hooks.items() if callable(getattr(mod, name, None))},
            **({"lr": twin["lr"]} if (twin or {}).get("lr") is not None else {})}


def run_calibrate(path: Path, expect: dict, twin: dict | None = None) -> bool | str | list:
    """Whether ``check --calibrate`` names the culprit (a string: why it crashed); for a ``twin``, the families
    of the alarms it gave (a list, empty when quiet): training warnings for a training fault's twin, warnings on
    the culprit or non-finite values for a forward fault's."""
    import ampaudit

    mod = _load(path)
    target = expect.get("target", {"device": "cpu", "dtype": "float16"})
    inputs = mod.example_inputs()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    build = getattr(mod, (twin or {}).get("entry") or "build_model")
    try:
        rep = ampaudit.check(build(), *args, **target, calibrate=True, **training_options(mod, expect, twin),
                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - a crash is a miss, reported with its reason
        return f"{type(exc).__name__}: {exc}"[:200]
    alarms = [f for f in rep.findings if f.severity in ("warning", "error")]
    if twin is not None and expect.get("phase") == "training":
        return sorted({f.family for f in alarms if f.family in ("swamping", "precursor")})
    if twin is not None:        # a forward fault's fixed version: nothing on the culprit, nothing non-finite
        return sorted({f.family for f in alarms if _names(f.module, _culprits(expect)) or f.family == "nonfinite"})
    return any(located(rep, c, None) for c in _culprits(expect)) or any(
        _names(f.module, _culprits(expect)) for f in rep.findings if f.severity in ("warning", "error"))


def run_twins(work: Path, only: set | None) -> list[dict]:
    """The healthy twins through both paths: each must stay quiet."""
    by_stem = {p.stem: p for p in planted_files()}
    rows = []
    for stem, twin in TWINS:
        if stem not in by_stem or (only and stem not in only):
            continue
        expect = getattr(_load(by_stem[stem]), "EXPECT", {})
        row = {"model": stem, "twin": twin, "calibrate_alarms": run_calibrate(by_stem[stem], expect, twin)}
        row.update(run_trace(by_stem[stem], expect, work, twin))
        rows.append(row)
        words = ", ".join(f"{k} {v}" for k, v in twin.items()) or "as it is"
        print(f"twin {stem} ({words}): calibrate {row['calibrate_alarms'] or 'quiet'}, train+report "
              f"{row.get('runtime_alarms') or row.get('runtime_error') or 'quiet'}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated model names (file stems)")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--no-twins", action="store_true", help="skip the healthy twins of the training faults")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in planted_files():
            expect = getattr(_load(path), "EXPECT", {})
            if expect.get("culprit") is None or (only and path.stem not in only):
                continue
            row = {"model": path.stem, "culprit": expect["culprit"], "phase": expect.get("phase", "forward")}
            cal = run_calibrate(path, expect)
            row["calibrate"] = cal is True
            if isinstance(cal, str):
                row["calibrate_error"] = cal
            row.update(run_trace(path, expect, Path(tmp)))
            row["runtime"] = row.get("runtime_by") is not None
            rows.append(row)
            print(f"{row['model']:28} {row['phase']:9} calibrate {'yes' if row['calibrate'] else 'NO ':3}  "
                  f"train+report {'yes' if row['runtime'] else 'NO '} ({row.get('runtime_by') or row.get('runtime_error') or '-'})",
                  flush=True)
        twins = [] if args.no_twins else run_twins(Path(tmp), only)
    n = len(rows)
    both = sum(r["calibrate"] and r["runtime"] for r in rows)
    print(f"\n{n} planted models: check --calibrate names {sum(r['calibrate'] for r in rows)}, "
          f"train --trace + report names {sum(r['runtime'] for r in rows)}, both {both}")
    if twins:
        print(f"{len(twins)} healthy twins: check --calibrate quiet on "
              f"{sum(r['calibrate_alarms'] == [] for r in twins)}, train --trace + report quiet on "
              f"{sum(r.get('runtime_alarms') == [] for r in twins)}")
    if args.json:
        args.json.write_text(json.dumps({"models": rows, "twins": twins}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
