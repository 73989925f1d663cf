"""``ampaudit fix --diff / --write``: fix the user's own source files, ruff-style, verified before writing.

    result = fix_source("model.py", device="cuda", dtype="float16")          # plan and verify; writes nothing
    print(result.diff())                                                     # unified diff of the user's files
    result.write()                                                           # atomic, only when verified
    result.to_dict()                                                         # the --format json summary

Each finding goes to the source fixer its rule's ``source_fix`` kind names (rules/*.toml). Safe edits keep FP32
results bitwise; unsafe ones (``unsafe=True``, ``--unsafe-fixes``) may change them. The measured faults
(``--calibrate``) of a module wait for the static fixes in it; when the re-check still measures them, a second
round runs that module in fp32.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ampaudit.findings import SEVERITY_RANK
from ampaudit.runtime.replay_state import rng_kept
from ampaudit.sourcefix.driver import MODULE_KIND, Plan, named_rules, plan_edits, source_fix_of, wanted
from ampaudit.sourcefix.verify import Mirror, SourceVerification, audit_with, load_mirror, verify_sources

SOURCE_FIX_VERSION = "1.0"


@dataclass
class SourceFixResult:
    target: str
    policy: dict
    plan: Plan
    verification: SourceVerification | None = None
    rounds: int = 1
    written: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> dict[str, str]:
        return self.plan.changed

    @property
    def verified(self) -> bool:
        return self.verification is None or self.verification.ok

    def diff(self, base: Path | None = None) -> str:
        """A unified diff of every changed file (paths relative to ``base``, the current folder by default)."""
        base = base or Path.cwd()
        out = []
        for path in sorted(self.changed):
            rel = _rel(path, base)
            out += difflib.unified_diff(self.plan.originals[path].splitlines(keepends=True),
                                        self.changed[path].splitlines(keepends=True),
                                        fromfile=f"a/{rel.lstrip('/')}", tofile=f"b/{rel.lstrip('/')}")
        return "".join(out)

    def write(self, *, force: bool = False) -> list[str]:
        """Write the changed files atomically, each keeping its mode (and owner where it can); refuse when a file
        changed meanwhile, or (unless ``force``) is read-only: nothing is written then."""
        import stat

        from ampaudit.errors import UsageError
        from ampaudit.fileio import atomic_write_text, read_only

        for path in self.changed:
            if Path(path).read_text(encoding="utf-8") != self.plan.originals[path]:
                raise UsageError(f"{path} changed while fix ran; nothing written", hint="run ampaudit fix again")
            if not force and read_only(path):
                mode = stat.S_IMODE(Path(path).stat().st_mode)
                raise UsageError(f"{path} is read-only (mode {mode:o}); nothing written",
                                 hint="make it writable (chmod u+w), or pass --force to write it keeping its mode")
        for path, text in self.changed.items():
            atomic_write_text(path, text, hint="make the model file writable")
            self.written.append(path)
        return self.written

    def to_dict(self, base: Path | None = None) -> dict:
        base = base or Path.cwd()
        v = self.verification
        recheck = {(r["rule"], r["file"], r["line"]) for r in (v.remaining if v else [])}
        edits = []
        for e in self.plan.edits:
            d = e.as_dict()
            d["file"] = _rel(e.file, base)
            d["verified"] = None if v is None else {
                "recheck_clean": not any(r == e.rule and f == e.file for r, f, _ in recheck),
                "fp32_bitwise": bool(v.outputs and v.outputs.fp32_bitwise)}
            edits.append(d)
        return {"version": SOURCE_FIX_VERSION, "target": self.target, "policy": self.policy, "rounds": self.rounds,
                "edits": edits,
                "not_fixed": [{**r.as_dict(), "file": _rel(r.file, base) if r.file else None}
                              for r in self.plan.refusals],
                "unsafe_available": [{**e.as_dict(), "file": _rel(e.file, base)} for e in self.plan.skipped_unsafe],
                "verification": v.as_dict() if v is not None else None,
                "changed": [_rel(p, base) for p in sorted(self.changed)],
                "written": [_rel(p, base) for p in self.written], "notes": self.notes}

    def lines(self, base: Path | None = None) -> list[str]:
        base = base or Path.cwd()
        pol = f"{self.policy.get('dtype')} autocast on {self.policy.get('device')}"
        out = [f"ampaudit fix {self.target} [{pol}]: {len(self.plan.edits)} edit(s) in {len(self.changed)} file(s)"]
        for e in self.plan.edits:
            out.append(f"  {e.rule} {_rel(e.file, base)}:{e.line} [{e.safety}] {e.module or '<top>'}: {e.description}")
        for e in self.plan.skipped_unsafe:
            out.append(f"  unsafe, not applied (--unsafe-fixes): {e.rule} {_rel(e.file, base)}:{e.line} "
                       f"{e.description}")
        for r in self.plan.refusals:
            where = f"{_rel(r.file, base)}:{r.line}" if r.file else r.module
            out.append(f"  not fixed: {r.rule} {where} {r.module or '<top>'}: {r.reason}; instead: {r.instead}")
        if self.verification is not None and self.changed:
            out += [f"verify: {line}" for line in self.verification.lines()]
        return out + self.notes

    def to_text(self, base: Path | None = None) -> str:
        return "\n".join(self.lines(base))


def _rel(path: str, base: Path) -> str:
    try:
        return os.path.relpath(path, base) if Path(path).resolve().is_relative_to(base.resolve()) else path
    except ValueError:
        return path


@rng_kept()      # loading the file builds the model and draws its inputs: a script's RNG must not notice
def fix_source(target: str, *, entry: str | None = None, inputs: Sequence[str] | None = None, device: str = "cuda",
               dtype: str = "float16", select: Sequence[str] | None = None, ignore: Sequence[str] | None = None,
               rules_dirs: Sequence[str] = (), calibrate: bool = False, unsafe: bool = False,
               verify: bool = True) -> SourceFixResult:
    """Plan, and unless ``verify=False`` verify, the source edits for ``target`` (a model file or pkg.mod:factory).
    Warnings and errors are fixed; info findings too for the rules ``select`` names by id or name."""
    from ampaudit.loading import load_target
    from ampaudit.rules.loader import load_rules

    rules = load_rules(list(rules_dirs))
    by_id = {r.id: r for r in rules}
    loaded = load_target(target, entry=entry, inputs=list(inputs) if inputs else None)
    from ampaudit.analysis.calibrate import calibration_data

    # check --calibrate's batches and loss (one choice): the edits fix what check measures.
    settings = {"device": device, "dtype": dtype, "select": select, "ignore": ignore, "rules_dirs": rules_dirs,
                "target": target, "calibrate": calibrate,
                "data": calibration_data(loaded, explicit_inputs=bool(inputs)) if calibrate else None}
    import copy

    original = copy.deepcopy(loaded.model)
    aud = audit_with(loaded.model, loaded, loaded, settings)
    named = named_rules(rules, select)
    plan = plan_edits(aud, loaded.model, rules, args=loaded.args, kwargs=loaded.kwargs, unsafe=unsafe, named=named)
    result = SourceFixResult(target=target, policy=aud.policy.describe(), plan=plan)
    if not plan.changed or not verify:
        if plan.changed:
            result.notes.append("not verified (--no-verify)")
        return result

    def is_wanted(f):
        return wanted(f, source_fix_of(by_id.get(f.rule)), named)

    def fixed_rules() -> set[str]:
        return {e.rule for e in plan.edits} | {f.rule for f in plan.deferred}

    def faults() -> bool:
        return any(by_id[r].severity == "error" for r in fixed_rules() if r in by_id)

    any_unsafe = lambda: any(e.safety == "unsafe" for e in plan.edits)  # noqa: E731
    with Mirror(plan.changed, target) as mirror:
        fixed, error = load_mirror(mirror, target, entry, inputs)
        if fixed is None:
            result.verification = SourceVerification(loads=False, load_error=error, fixed_rules=sorted(fixed_rules()))
            return result
        v, aud2 = verify_sources(mirror, loaded, fixed, original, settings=settings, fixed_rules=fixed_rules(),
                                 faults=faults(), unsafe=any_unsafe(), wanted=is_wanted)
    again = {(r["rule"], r["module"]) for r in v.remaining}
    if calibrate and any(source_fix_of(by_id.get(r)).get("kind") == MODULE_KIND for r, _ in again):
        # Round 2: the measured faults a static fix did not remove; their modules run in fp32.
        with Mirror(plan.changed, target) as mirror:
            fixed, error = load_mirror(mirror, target, entry, inputs)
            if fixed is not None:
                aud2 = audit_with(fixed.model, loaded, fixed, settings)   # settings["calibrate"] is True here
                second = plan_edits(aud2, fixed.model, rules, args=loaded.args, kwargs=loaded.kwargs,
                                    texts=plan.changed, unsafe=unsafe, canon=mirror.canon, named=named,
                                    only=lambda f: (f.rule, f.module) in again and source_fix_of(
                                        by_id.get(f.rule)).get("kind") == MODULE_KIND)
                _merge(plan, second)
                result.rounds = 2
        with Mirror(plan.changed, target) as mirror:
            fixed, error = load_mirror(mirror, target, entry, inputs)
            if fixed is None:
                result.verification = SourceVerification(loads=False, load_error=error,
                                                         fixed_rules=sorted(fixed_rules()))
                return result
            v, _ = verify_sources(mirror, loaded, fixed, original, settings=settings, fixed_rules=fixed_rules(),
                                  faults=faults(), unsafe=any_unsafe(), wanted=is_wanted)
    result.verification = v
    return result


def _merge(plan: Plan, second: Plan) -> None:
    """Fold a second round into the first: its texts start from the first's, its edits follow."""
    for path, text in second.texts.items():
        plan.originals.setdefault(path, second.originals[path])
        plan.texts[path] = text
    deferred_done = {(e.rule, e.module) for e in second.edits}
    plan.deferred = [f for f in plan.deferred if (f.rule, f.module) not in deferred_done]
    plan.edits += second.edits
    plan.refusals += second.refusals
    plan.skipped_unsafe += second.skipped_unsafe


__all__ = ["SourceFixResult", "fix_source", "SEVERITY_RANK"]
