"""bench/gpu_day.py's truth parts: what CUDA autocast really does, against what ampaudit says it does.

    policy_truth(record, part_budget, dev, cfg)       # output dtypes: real device vs rules/policy vs simulation
    calibration_truth(record, part_budget, dev, cfg)  # check --calibrate findings: real device vs simulated

The real side runs on ``dev`` (bench/gpu_day_device.py); the simulated side is the CPU simulation
(ampaudit.simulate) that every CUDA claim of ampaudit rests on. On the GPU the two are independent; in tests
``dev`` is the simulation itself, so the plumbing runs end to end and a device that is plain CPU autocast
(no simulation) shows the disagreements a wrong policy would.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))          # _autocast_lists: PyTorch's own autocast test lists

from gpu_day_device import Device, simulated_cuda  # noqa: E402
from gpu_day_record import PartBudget, Record  # noqa: E402
from ampaudit.policy import Policy, op_names  # noqa: E402
from ampaudit.quiet import quiet  # noqa: E402

# Where a list's entries are looked up besides Tensor (test/test_cuda.py's test_autocast_*), by name prefix.
LIST_MODULES = {"torch": torch, "nn": torch._C._nn, "linalg": torch._C._linalg, "methods": None}
MODEL_FOLDERS = ("samples", "tests/planted", "tests/assets/planted")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def model_files(limit: int | None = None) -> list[Path]:
    files = sorted(p for folder in MODEL_FOLDERS for p in (ROOT / folder).glob("*.py") if not p.name.startswith("_"))
    return files[:limit] if limit else files


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _first_dtype(out: Any) -> str:
    t = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    return _name(t.dtype) if t is not None else "no tensor"


def run_entry(dev: Device, low: torch.dtype, module, op: str, args: tuple, kwargs: dict) -> dict[str, str]:
    """Output dtype of each way the list's test calls ``op`` (``fn``: the module function, ``method``: the
    Tensor method), under ``dev``'s autocast in ``low``; ``raises: ...`` where the call raises."""
    ways = {}
    if module is not None and hasattr(module, op):
        ways["fn"] = lambda: getattr(module, op)(*args, **kwargs)
    if hasattr(torch.Tensor, op) and args and isinstance(args[0], torch.Tensor):
        ways["method"] = lambda: getattr(args[0], op)(*args[1:], **kwargs)
    out = {}
    for way, call in ways.items():
        try:
            with warnings.catch_warnings(), dev.autocast(low), torch.no_grad():
                warnings.simplefilter("ignore")      # the lists call torch.cross without dim
                out[way] = _first_dtype(call())
        except Exception as exc:           # banned ops, CUDA-only kernels on the CPU side
            out[way] = f"raises: {type(exc).__name__}"
    return out


def policy_dtype(policy: Policy, op: str, args: tuple, kwargs: dict) -> str:
    """The output dtype rules/policy/cuda.toml gives ``op`` on these inputs (its category, through ops.toml's
    aliases; no category: the inputs' promoted dtype)."""
    cat = policy.category(op_names()["aliases"].get(op, op))
    floats = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if cat == "banned":
        return "raises"
    if cat == "lower":
        return _name(policy.low)
    if cat in ("fp32", "fp32_output"):
        return _name(kwargs.get("dtype") or torch.float32)
    if not floats:
        return "no float input"
    widest = floats[0]
    for d in floats[1:]:
        widest = torch.promote_types(widest, d)
    return _name(widest)


def disagree(real: str, policy: str, simulated: str) -> bool:
    """Whether one list entry's outcomes differ. The policy speaks of floating outputs only (a comparison's bool
    follows no autocast table); an entry that raises the same way on both sides is broken, not a disagreement
    (the lists' einsum pairs a 4-D equation with 2-D operands)."""
    if real != simulated:
        return True
    if real.startswith("raises"):
        return False
    return real in ("float16", "bfloat16", "float32", "float64") and policy != real


def list_entries(device_type: str) -> Iterator[tuple[str, str, Any, tuple, dict]]:
    """(list name, op, module, args, kwargs) of PyTorch's CUDA autocast test lists, tensors on ``device_type``."""
    from _autocast_lists import autocast_lists, split

    lists, _ = autocast_lists(device_type)
    for name, entries in vars(lists).items():
        prefix = name.split("_", 1)[0]
        if not isinstance(entries, list) or prefix not in (*LIST_MODULES, "banned"):
            continue
        for entry in entries:
            op, args, kwargs = split(entry)
            # A banned entry names its module third: (op, args, torch._C._nn).
            module = entry[2] if prefix == "banned" else LIST_MODULES[prefix]
            yield name, op, module, tuple(args), kwargs


def compare_lists(dev: Device, dtype: str, part: PartBudget) -> tuple[int, list[dict]]:
    """(entries compared, the rows where the real dtype, the policy's and the simulation's are not all equal)."""
    policy, low, sim = Policy.load("cuda", dtype), DTYPES[dtype], simulated_cuda()
    real_entries = list_entries(dev.type)
    rows, compared = [], 0
    for (name, op, module, args, kwargs), (_, _, _, cargs, ckwargs) in zip(real_entries, list_entries("cpu")):
        if part.expired():
            break
        real = run_entry(dev, low, module, op, args, kwargs)
        simulated = run_entry(sim, low, module, op, cargs, ckwargs)
        want = policy_dtype(policy, op, cargs, ckwargs)
        compared += 1
        for way in real:
            got, s = real[way], simulated.get(way, "not run")
            if disagree(got, want, s):
                rows.append({"dtype": dtype, "list": name, "op": op, "way": way, "cuda": got, "rules/policy": want,
                             "simulation": s, "note": "no CPU kernel" if s.startswith("raises: NotImpl") else ""})
    return compared, rows


class _Recorder(torch.fx.Interpreter):
    """Runs a graph for real and records each node's output dtype."""

    def __init__(self, gm):
        super().__init__(gm)
        self.dtypes: dict[str, str] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = _name(out.dtype)
        return out


def _record_dtypes(gm, inputs: tuple, dev: Device, low: torch.dtype) -> tuple[dict[str, str], str]:
    rec = _Recorder(dev.put(copy.deepcopy(gm)))
    try:
        with quiet(), dev.autocast(low), torch.no_grad():
            rec.run(*dev.put(inputs))
        return rec.dtypes, ""
    except Exception as exc:             # mask_fill_crash raises under fp16 autocast, as it should: keep what ran
        return rec.dtypes, f"{type(exc).__name__}: {str(exc)[:80]}"


def compare_nodes(path: Path, dtype: str, dev: Device) -> tuple[int, list[dict]]:
    """(nodes compared, rows where a node's static dtype, its real one and its simulated one are not all equal)
    for the model file ``path``: the static audit's node.meta["amp"] is what rules/policy says."""
    from ampaudit.analysis import AMP_KEY
    from ampaudit.api import audit
    from ampaudit.loading import load_target

    loaded = load_target(str(path))
    with quiet():
        result = audit(loaded.model.eval(), *loaded.args, device="cuda", dtype=dtype, **loaded.kwargs)
    gm = result.capture.gm
    inputs = tuple(result.capture.graph_inputs(loaded.args, loaded.kwargs)[0])
    low = DTYPES[dtype]
    real, real_err = _record_dtypes(gm, inputs, dev, low)
    sim, sim_err = _record_dtypes(gm, inputs, simulated_cuda(), low)
    rows, compared = [], 0
    for n in gm.graph.nodes:
        if AMP_KEY not in n.meta or n.name not in real or n.name not in sim:
            continue
        compared += 1
        static = _name(n.meta[AMP_KEY].dtype)
        if not static == real[n.name] == sim[n.name]:
            rows.append({"dtype": dtype, "model": f"{path.parent.name}/{path.name}", "node": n.format_node()[:90],
                         "cuda": real[n.name], "rules/policy": static, "simulation": sim[n.name]})
    if real_err != sim_err:
        rows.append({"dtype": dtype, "model": f"{path.parent.name}/{path.name}", "node": "(forward)",
                     "cuda": real_err or "ran", "rules/policy": "", "simulation": sim_err or "ran"})
    return compared, rows


def _models(part: PartBudget, cfg: dict) -> Iterator[Path]:
    """The model files in turn, until the part's budget is spent (``part.stopped`` then says so)."""
    part.stopped = False
    for path in model_files(cfg.get("models")):
        if part.expired():
            part.stopped = True
            return
        yield path


def _error_row(dtype: str, path: Path, exc: Exception) -> dict:
    return {"dtype": dtype, "model": f"{path.parent.name}/{path.name}", "error": f"{type(exc).__name__}: {exc}"[:160]}


def policy_truth(record: Record, part: PartBudget, dev: Device, cfg: dict) -> str:
    """Output dtypes of every autocast test-list op and every model node: real vs rules/policy vs simulation."""
    rows: list[dict] = []
    for dtype in cfg.get("dtypes", DTYPES):
        compared, found = compare_lists(dev, dtype, part)
        rows += found
        record.figure("policy", f"{dtype}: autocast test-list ops disagreeing", len(found), unit="rows",
                      baseline=("entries compared", compared), note="goal: 0")
        record.table("policy", "disagreements", rows)
    for dtype in cfg.get("dtypes", DTYPES):
        nodes = bad = models = 0
        for path in _models(part, cfg):
            try:
                compared, found = compare_nodes(path, dtype, dev)
            except Exception as exc:      # a model that cannot run there is a row, not the end of the part
                compared, found = 0, [_error_row(dtype, path, exc)]
            nodes, bad, models = nodes + compared, bad + len(found), models + 1
            rows += found
            record.table("policy", "disagreements", rows)
        record.figure("policy", f"{dtype}: model nodes disagreeing", bad, unit="nodes",
                      baseline=("nodes compared", nodes),
                      note=f"goal: 0; {models} models" + (", stopped by the budget" if part.stopped else ""))
        if part.stopped:
            return "stopped: budget"
    return "done"


def findings_of(path: Path, dtype: str, dev: Device | None) -> set[tuple[str, str]]:
    """(rule, module) of every finding of ``check --calibrate`` on the model file ``path`` for the CUDA
    ``dtype`` target: ``dev=None`` as the CLI does it (simulated on CPU), else calibrated on ``dev``."""
    from ampaudit.analysis.calibrate import calibrate
    from ampaudit.api import audit
    from ampaudit.loading import load_target
    from ampaudit.rules.engine import run_rules
    from ampaudit.rules.loader import load_rules
    from ampaudit.rules.registry import MatchContext

    loaded = load_target(str(path))
    with quiet():
        result = audit(loaded.model, *loaded.args, device="cuda", dtype=dtype, calibrate=dev is None,
                       **loaded.kwargs)
        if dev is None:
            return {(f.rule, f.module) for f in result.report.findings}
        model = dev.put(copy.deepcopy(loaded.model))
        ctx = MatchContext(gm=result.capture.gm, root=result.capture.root, policy=result.policy)
        # The simulated device is the CPU path calibrate takes for a CUDA target; the real one its own autocast.
        ctx.calibration = calibrate(model, [(dev.put(loaded.args), dev.put(loaded.kwargs))], result.policy,
                                    device_type="cpu" if dev.simulated else dev.type)
        return {(f.rule, f.module) for f in run_rules(ctx, load_rules([]))[0]}


def calibration_truth(record: Record, part: PartBudget, dev: Device, cfg: dict) -> str:
    """check --calibrate on the real device against the simulated CUDA target: the same findings, per module."""
    rows: list[dict] = []
    for dtype in cfg.get("dtypes", DTYPES):
        same = total = 0
        for path in _models(part, cfg):
            total += 1
            try:
                simulated, real = findings_of(path, dtype, None), findings_of(path, dtype, dev)
            except Exception as exc:      # a model that cannot run there is a row, not the end of the part
                rows.append(_error_row(dtype, path, exc))
            else:
                same += simulated == real
                rows += [{"dtype": dtype, "model": f"{path.parent.name}/{path.name}", "rule": rule, "module": module,
                          "found by": "simulation only" if (rule, module) in simulated else "real device only"}
                         for rule, module in sorted(simulated ^ real)]
            record.table("calibration", "differing findings", rows)
        record.figure("calibration", f"{dtype}: models with identical findings", same, unit="models",
                      baseline=("models compared", total),
                      note="goal: all" + (", stopped by the budget" if part.stopped else ""))
        if part.stopped:
            return "stopped: budget"
    return "done"
