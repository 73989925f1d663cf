"""Mixed-precision safety as a test assertion.

    from ampaudit.testing import assert_amp_safe

    def test_model_is_fp16_safe():
        model = MyNet()
        assert_amp_safe(model, torch.randn(8, 64))                       # CUDA fp16 policy, fails on warnings
        assert_amp_safe(model, x, device="cpu", dtype="bfloat16", fail_on="error", ignore=["AMP403"])
        assert_amp_safe(model, x, calibrate=True)   # also run it: measured overflow and inf/NaN fail too
        assert_amp_safe(model, x, speed=True)       # misaligned GEMM dims (slower kernels) fail too

Safety and speed are told apart: by default only safety findings (wrong, lost or non-finite numbers) fail;
alignment findings (a GEMM on a slower kernel) fail only with ``speed=True``.

A clean model passes silently (the :class:`~ampaudit.findings.Report` is returned); otherwise the test fails
with an :class:`AmpSafetyError` (an ``AssertionError``) whose message is a plain-text table of the findings at or
above ``fail_on``. A model with parts the audit could not look into (``report.unaudited``: a wrapped function's
body it could not record) passes with an :class:`UnauditedWarning` naming the first. With the pytest plugin installed, the ``amp_audit`` fixture does the same with the defaults of
``[tool.ampaudit]`` in the project's pyproject.toml.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from ampaudit.errors import UsageError
from ampaudit.findings import SEVERITY_RANK, Finding, Report, location_text
from ampaudit.user_warnings import warn_at_user

__all__ = ["assert_amp_safe", "AmpSafetyError", "format_findings"]

FAIL_ON = ("error", "warning", "info", "never")
TABLE_WIDTH = 140


class UnauditedWarning(UserWarning):
    """Part of the model could not be audited (``report.unaudited``): a pass does not cover it."""


class AmpSafetyError(AssertionError):
    """A model failed :func:`assert_amp_safe`; ``report`` holds every finding, ``failing`` those that failed."""

    def __init__(self, message: str, report: Report, failing: list[Finding]):
        super().__init__(message)
        self.report = report
        self.failing = failing


def _where(f: Finding) -> str:
    # A user's file by its last two parts; a library's line in full below site-packages, marked "(library)".
    return location_text(f.location, lambda path: "/".join(str(path).replace("\\", "/").split("/")[-2:]))


def format_findings(findings: Sequence[Finding], *, width: int = TABLE_WIDTH) -> str:
    """A plain-text table (no colour) of ``findings``: severity, rule, module, source line, message and fix."""
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table

    table = Table(box=SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for name in ("severity", "rule", "module", "where"):
        table.add_column(name, no_wrap=True)
    table.add_column("finding", overflow="fold")
    for f in sorted(findings, key=lambda f: -SEVERITY_RANK[f.severity]):
        body = f.message + (f"\nfix: {f.fix}" if f.fix else "")
        table.add_row(f.severity, f"{f.rule} {f.name}", f.module or "<top>", _where(f), body)
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines())


def assert_amp_safe(model: Any, *example_inputs: Any, device: str = "cuda", dtype: str = "float16",
                    fail_on: str = "warning", calibrate: bool = False, speed: bool = False,
                    select: Sequence[str] | None = None, ignore: Sequence[str] | None = None, rules_dirs: Sequence[str | Path] = (),
                    **example_kwargs: Any) -> Report:
    """Fail the calling test if ``model(*example_inputs, **example_kwargs)`` has findings at or above
    ``fail_on`` for the ``device``/``dtype`` autocast target; return the report otherwise.

    ``fail_on``: "error", "warning", "info" or "never" (report only). ``speed``: speed findings (the alignment
    family: dims off the Tensor Core multiple) fail too; by default they are reported, not failed. ``calibrate``: also run the model on the
    example inputs in FP32 and under the target's autocast (as ``ampaudit check --calibrate``): measured
    overflow, inf/NaN origins and divergence become findings. ``select``/``ignore``/``rules_dirs`` work as in
    ``ampaudit check``.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    if fail_on not in FAIL_ON:
        raise UsageError(f"assert_amp_safe(): unknown fail_on {fail_on!r}", hint=f"use one of {', '.join(FAIL_ON)}")
    from ampaudit.api import check

    report = check(model, *example_inputs, device=device, dtype=dtype, select=select, ignore=ignore,
                   rules_dirs=rules_dirs, base_dir=Path.cwd(), calibrate=calibrate, **example_kwargs)
    if report.unaudited:
        more = f" (and {len(report.unaudited) - 1} more)" if len(report.unaudited) > 1 else ""
        warn_at_user(f"{type(model).__name__}: part of the model was not audited: {report.unaudited[0]}{more}",
                     UnauditedWarning)
    failing = [f for f in report.at_or_above(fail_on) if speed or not f.is_speed] if fail_on != "never" else []
    if failing:
        pol = report.policy
        lower = len(report.findings) - len(failing)
        what = "fast" if all(f.is_speed for f in failing) else "safe"
        head = (f"{type(model).__name__} is not mixed-precision {what} for {pol.get('device')} {pol.get('dtype')} "
                f"autocast: {len(failing)} finding(s) at or above {fail_on!r}"
                + (f" (and {lower} below)" if lower else ""))
        raise AmpSafetyError(f"{head}\n\n{format_findings(failing)}\n\n"
                             "explain a rule with: ampaudit rules explain ID; silence one line with "
                             "'# ampaudit: ignore[ID]'", report, failing)
    return report
