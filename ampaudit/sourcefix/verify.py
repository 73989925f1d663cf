"""Verify edited sources before they are written: load the edited copy, compare it with the original model in
FP32 and under autocast (``ampaudit.rewrite.verify.verify_outputs``), and audit it again (``ampaudit.api.audit``).

    with Mirror(plan.changed, target) as mirror:
        v = verify_sources(mirror, loaded, original, fixed_rules=..., settings=...)
        v.ok, v.lines()

The copy lives in a temporary folder that mirrors the edited files' paths, so the user's files are untouched
until everything checks out; the edited model gets the original's weights (``load_state_dict``), so FP32
outputs compare bit for bit whatever the factory's seeding.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.errors import AmpAuditError
from ampaudit.findings import SEVERITY_RANK


class Mirror:
    """A temporary copy of the edited files (and the target file) under their common folder's layout."""

    def __init__(self, texts: dict[str, str], target: str | None):
        self.texts = texts
        self.target = str(Path(target).resolve()) if target and target.endswith(".py") else None
        paths = list(texts) + ([self.target] if self.target else [])
        self.root = Path(os.path.commonpath([str(Path(p).parent) for p in paths])) if paths else Path.cwd()
        self.dir: Path | None = None
        self.hidden: dict = {}

    def __enter__(self) -> "Mirror":
        self.dir = Path(tempfile.mkdtemp(prefix="ampaudit-fix-"))
        edited = {Path(p).resolve() for p in self.texts}
        self._populate(self.root, self.dir, edited)
        for path, text in self.texts.items():
            self.map(path).write_text(text, encoding="utf-8")
        return self

    def _populate(self, src: Path, dst: Path, edited: set[Path]) -> None:
        """Real folders on the way to an edited file, links to everything else: the model's data files and
        sibling modules are where its code looks for them (``Path(__file__).parent / "data"``)."""
        for entry in src.iterdir():
            inside = [p for p in edited if p == entry or entry in p.parents]
            if not inside:
                if entry.name != "__pycache__":
                    os.symlink(entry, dst / entry.name, target_is_directory=entry.is_dir())
            elif entry.is_dir():
                (dst / entry.name).mkdir()
                self._populate(entry, dst / entry.name, edited)

    def __exit__(self, *exc) -> None:
        # The copy's modules stay imported while the mirror lives (inspect finds its classes' source through
        # them); then they go, and the user's own modules come back.
        for n in list(sys.modules):
            if (_file_of(sys.modules[n]) or "").startswith(str(self.dir)):
                del sys.modules[n]
        sys.modules.update(self.hidden)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def map(self, path: str) -> Path:
        return self.dir / Path(path).resolve().relative_to(self.root)

    def canon(self, path: str) -> str:
        """A mirrored path back to the user's file (any other path unchanged)."""
        p = Path(path)
        if self.dir is not None and p.is_relative_to(self.dir):
            return str(self.root / p.relative_to(self.dir))
        return path


@dataclass
class SourceVerification:
    loads: bool
    load_error: str | None = None
    outputs: Any = None                           # ampaudit.rewrite.verify.Verification
    weights: str = "loaded"                       # the original's state_dict went in; else why not
    remaining: list[dict] = field(default_factory=list)
    fixed_rules: list[str] = field(default_factory=list)
    faults: bool = False                          # a fixed rule is a fault (error severity): autocast must improve
    unsafe: bool = False
    unaudited: list[str] = field(default_factory=list)   # what the re-check could not look into (its notes)

    @property
    def fp32_ok(self) -> bool:
        return self.outputs is not None and (self.outputs.fp32_bitwise or self.unsafe)

    @property
    def amp_no_worse(self) -> bool:
        # The edited model's max relative error may exceed the original's by one unit roundoff of the dtype
        # (2**-11 for fp16, 2**-8 for bf16): a difference that small is where one rounding lands, not a loss of
        # accuracy (an fp32 block hands the next fp16 layer differently rounded inputs).
        from ampaudit.dtypes import low_dtype, unit_roundoff

        return self.outputs is not None and not worse(self.outputs.after, self.outputs.before,
                                                      unit_roundoff(low_dtype(self.outputs.dtype)))

    @property
    def amp_better(self) -> bool:
        return self.outputs is not None and better(self.outputs.after, self.outputs.before)

    @property
    def fault_shown(self) -> bool:
        """The original raised or gave inf/NaN in the verification run (a fault simulated for another device,
        such as CUDA's autocast on a CPU, may not show there; the re-check measures it in simulation)."""
        b = self.outputs.before if self.outputs is not None else None
        return b is not None and (b.error is not None or b.nonfinite > 0)

    @property
    def ok(self) -> bool:
        return (self.loads and self.fp32_ok and self.amp_no_worse and not self.remaining
                and (self.amp_better or not (self.faults and self.fault_shown)))

    def as_dict(self) -> dict:
        return {"ok": self.ok, "loads": self.loads, "load_error": self.load_error, "weights": self.weights,
                "fp32_ok": self.fp32_ok, "autocast_no_worse": self.amp_no_worse, "autocast_better": self.amp_better,
                "fixed_rules": self.fixed_rules, "remaining": self.remaining, "unaudited": self.unaudited,
                "outputs": self.outputs.as_dict() if self.outputs is not None else None}

    def lines(self) -> list[str]:
        if not self.loads:
            return [f"the edited file does not load: {self.load_error}"]
        out = self.outputs.lines()[:2] if self.outputs is not None else []
        if self.weights != "loaded":
            out.append(f"weights: {self.weights}")
        if self.remaining:
            rules = ", ".join(sorted({r["rule"] for r in self.remaining}))
            out.append(f"re-check: {len(self.remaining)} finding(s) of the fixed rules remain ({rules})")
        else:
            out.append(f"re-check: clean for {', '.join(self.fixed_rules) or 'the fixed rules'}"
                       + (" in what it audited" if self.unaudited else ""))
            out += [f"re-check could not look into: {n}" for n in self.unaudited]
        if not self.amp_no_worse:
            out.append("autocast error against FP32 got worse")
        elif self.faults and self.fault_shown and not self.amp_better:
            out.append("autocast error against FP32 did not improve, though a fault was fixed")
        return out


def _key(run) -> tuple:
    rel = run.rel_err if run.rel_err is not None else float("inf")
    return (run.error is not None, run.nonfinite, rel)


def worse(after, before, slack: float = 0.0) -> bool:
    a, b = _key(after), _key(before)
    if a[:2] != b[:2]:
        return a[:2] > b[:2]
    return a[2] > b[2] + slack


def better(after, before) -> bool:
    a, b = _key(after), _key(before)
    if a[:2] != b[:2]:
        return a[:2] < b[:2]
    return a[2] < b[2]


def load_mirror(mirror: Mirror, target: str, entry: str | None, inputs: list[str] | None):
    """The edited model loaded from the mirror (a LoadedTarget), or the error that stopped it."""
    from ampaudit.loading import load_target

    where = str(mirror.map(str(Path(target).resolve()))) if target.endswith(".py") else target
    # Modules already imported from an edited file would be reused by the copy's imports: hide them while the
    # copy loads, and put them back after, so the user's process keeps its own.
    edited = {str(Path(p).resolve()) for p in mirror.texts}
    hidden = {n: m for n, m in list(sys.modules.items()) if _file_of(m) in edited}
    for n in hidden:
        del sys.modules[n]
    mirror.hidden.update(hidden)
    sys.path.insert(0, str(mirror.dir))
    try:
        return load_target(where, entry=entry, inputs=inputs), None
    except AmpAuditError as exc:
        return None, exc.one_line()
    finally:
        sys.path.remove(str(mirror.dir))


def _file_of(module) -> str | None:
    f = getattr(module, "__file__", None)
    try:
        return str(Path(f).resolve()) if f else None
    except (OSError, ValueError):
        return None


def verify_sources(mirror: Mirror, loaded, fixed, original_model, *, settings: dict, fixed_rules: set[str],
                   faults: bool, unsafe: bool, wanted) -> tuple[SourceVerification, Any]:
    """Compare ``fixed`` (a LoadedTarget from the mirror) with the original; returns the verification and the
    edited model's audit (for a second round of fixes)."""
    from ampaudit.policy import Policy
    from ampaudit.rewrite.verify import verify_outputs
    from ampaudit.runtime.replay_state import model_device

    v = SourceVerification(loads=True, fixed_rules=sorted(fixed_rules), faults=faults, unsafe=unsafe)
    model = fixed.model
    try:
        model.load_state_dict(original_model.state_dict())
    except RuntimeError as exc:
        v.weights = "the edited model's weights differ in shape (" + " ".join(str(exc).split())[:120] + ")"
    device_type = model_device(original_model)
    v.outputs = verify_outputs(original_model, model, loaded.args, loaded.kwargs, device_type=device_type,
                               policy=Policy.load(settings["device"], settings["dtype"]))
    aud = audit_with(model, loaded, fixed, settings)
    v.remaining = [{"rule": f.rule, "module": f.module, "op": f.op, "message": f.message,
                    "file": mirror.canon(f.location["file"]) if f.location else None,
                    "line": f.location["line"] if f.location else None}
                   for f in aud.report.findings if f.rule in fixed_rules and wanted(f)
                   and SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"]]
    v.unaudited = list(aud.report.unaudited)
    return v, aud


def audit_with(model, loaded, hooks, settings: dict):
    """``ampaudit.api.audit`` of ``model`` on ``loaded``'s example inputs, under fix's ``settings``; a calibrated
    audit runs on ``settings["data"]`` (check --calibrate's batches) with the loss_fn of ``hooks`` (the
    LoadedTarget the model came from)."""
    import dataclasses

    from ampaudit.api import audit

    data = settings.get("data")
    if data is not None and data.loss_fn is not None:
        data = dataclasses.replace(data, loss_fn=hooks.hook("loss_fn"))
    return audit(model, *loaded.args, device=settings["device"], dtype=settings["dtype"], select=settings["select"],
                 ignore=settings["ignore"], rules_dirs=settings["rules_dirs"], target=settings["target"],
                 capture_mode="auto", calibrate=settings["calibrate"], data=data, **loaded.kwargs)
