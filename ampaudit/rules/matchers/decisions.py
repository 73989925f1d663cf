"""Matcher over the decisions ``check --calibrate`` compared with FP32 (``ctx.calibration.decisions``: rows of
:mod:`ampaudit.runtime.decision_record`); silent without calibration.

A decision site is reported when the forward uses its result (``used``: a classifier's returned predictions are
not reported) and its share of flipped decisions, FP32 ties left out, reaches ``min_share`` with at least
``min_flipped`` flips (rules/policy/settings.toml ``[decisions]``). The module named is the one whose own forward
runs the decision op, with the op's source line; worst share first.
"""
from __future__ import annotations

from pathlib import PurePath
from typing import Iterator

from ampaudit.rules.matchers.calibrated import _source
from ampaudit.rules.registry import Hit, MatchContext, matcher
from ampaudit.runtime.decisions import decision_limits, flagged


@matcher("calibrated_decisions", fields={"share", "flipped", "decisions", "what", "source", "at", "calls"})
def calibrated_decisions(ctx: MatchContext, rule) -> Iterator[Hit]:
    cal = ctx.calibration
    if cal is None:
        return
    limits = decision_limits()
    rows = sorted((r for r in cal.decisions if flagged(r, limits)), key=lambda r: -r["share_flipped"])
    for row in rows:
        yield Hit(None, {"share": row["share_flipped"], "flipped": row["flipped"], "decisions": row["decisions"],
                         "what": row["what"], "source": row["source"] or "?", "at": _file_line(row["source"]),
                         "calls": row["calls"]},
                  module=row["module"], op=row["op"], source=_source(row["source"]))


def _file_line(source: str | None) -> str:
    # The op's file by its name, for the message (the where column, JSON and ``source`` carry the path): a
    # library's full path below site-packages made the message wrap, cut off mid-path.
    if not source:
        return "?"
    path, sep, line = source.rpartition(":")
    return f"{PurePath(path).name}:{line}" if sep and line.isdigit() else source
