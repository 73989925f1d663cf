"""Which modules are the culprits of a run's low-precision error: one verdict for ``check --calibrate`` and for
``ampaudit report``.

    found = culprits({"mlp.fc": 0.003, "attn": 0.066, "head": 0.002, ...}, torch.bfloat16)
    found[0].module, found[0].rule, found[0].severity, found[0].why     # "attn", "relative", "warning", "..."
    first = first_crossing(found, [("attn", step, rel_l2), ...])         # where the first culprit shows

The input is each module's *own* error (relative L2 against FP32 of the module run alone under autocast on the
inputs it really receives, a composite with its children computed in FP32: see
:mod:`ampaudit.runtime.divergence`, scope ``local``), keyed by dotted module name. Two lines judge it
(rules/policy/settings.toml ``[calibration]`` and ``[attribution]``):

- **absolute**: at least ``divergence_warning_u`` unit roundoffs of the dtype (32 u: 1.6% in fp16, 12.5% in
  bf16) is a warning, ``divergence_error_u`` (128 u) an error; inf/NaN is an error. What the rule had before.
- **relative**: at least ``floor_u`` unit roundoffs *and* at least ``outlier_ratio`` times the median own error
  of the model's other modules measured in the same dtype (modules with an exact 0, which compute nothing in
  the low dtype, are not peers; with fewer than ``min_peers`` peers there is no median to stand out from). A
  module at 6.6% in a bf16 model whose GEMMs sit at 0.3% is 20x the model's normal error. It is a warning,
  never an error: the module is far noisier than the rest of the model, which is worth a look, but the dtype
  alone would not call its error a fault.

An own error that rounding alone explains is not judged: at most ``rounding_explains`` times what the module's
inputs (a composite's children's outputs included) lost by being rounded to their real dtypes plus what storing
the exact answer in its output dtype loses (``rounding``: module -> that sum of two relative L2s). In the dtype's
normal range each rounding loses at most a unit roundoff, so the excuse stays under the lines there and only
covers modules that see values in the dtype's subnormals (a random-init net whose activations are ~1e-5 in
fp16), which AMP503 reports where they are produced. Cancellation is still caught: rounding 0.2 u of its
inputs does not explain a difference that comes out 30% wrong. A non-finite own error is not the module's code
either when rounding alone already lost everything around it: its inputs were inf in the dtype before it ran
(``fed_inf``: an overflow upstream, reported where it happens: AMP501, and AMP601/AMP701 at the module that
makes it; every module after it reads NaN against FP32; :func:`excused_nonfinite` adds the modules whose FP32
answer is all zero), or at least ``rounding_total`` (a relative L2 of 1: the
whole tensor) was lost, where its exact answer or its inputs flush to zero (AMP503) and the relative error
divides by a reference that is zero in the dtype. An exact answer that is itself non-finite excuses nothing.
Nor is a finite own error judged where FP32 does not determine the answer either (``unstable``,
:func:`fp32_unstable`): moving the module's FP32 inputs by one unit in the last place already moves its FP32 output
past the line (:mod:`ampaudit.runtime.fp32_floor`; a GroupNorm normalising a constant signal on untrained weights).

With own errors, a composite's value no longer holds its children's, so a flagged child does not excuse its
parent and vice versa. One exception stays: a non-finite own error of a module with a non-finite descendant is
the descendant's overflow reaching it (the re-run hands the composite its children's results rounded to the
low dtype, inf included), so the descendant is named. ``inherited=True`` is for values that accumulate from the
input on (scope ``global``, what traces without own errors hold): a module is left out when a module below it
is flagged, as the rule did before own errors existed.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import torch

from ampaudit.dtypes import low_dtype, unit_roundoff
from ampaudit.policy import divergence_thresholds, settings


@dataclass(frozen=True)
class Culprit:
    """A flagged module: its own error, the line it crossed and why. ``rank`` 1 is the worst."""

    module: str
    rel_l2: float            # own error (NaN or inf: non-finite)
    units: float             # rel_l2 in unit roundoffs of the dtype
    ratio: float | None      # rel_l2 over the model's median own error (None without enough peers)
    median: float | None
    peers: int
    rule: str                # "absolute" | "relative" | "nonfinite"
    severity: str            # "error" | "warning"
    line: float              # the relative L2 it crossed
    rank: int
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def peer_median(own: Mapping[str, float | None]) -> tuple[float | None, int]:
    """(median of the finite nonzero own errors, how many there are); the median is None below ``min_peers``."""
    peers = [v for v in own.values() if v is not None and math.isfinite(v) and v > 0]
    if len(peers) < int(settings()["attribution"]["min_peers"]):
        return None, len(peers)
    return statistics.median(peers), len(peers)


def _is_below(name: str, other: str) -> bool:
    return other != name and (name == "" or other.startswith(name + "."))


def _verdict(v: float, dtype: torch.dtype, median: float | None) -> tuple[str, str, float] | None:
    """(rule, severity, line) for one own error, None when it is not flagged."""
    warn, err = divergence_thresholds(dtype)
    if not math.isfinite(v):
        return "nonfinite", "error", warn
    if v >= warn:
        return "absolute", ("error" if v >= err else "warning"), warn
    cfg = settings()["attribution"]
    if median is not None:
        line = max(cfg["floor_u"] * unit_roundoff(dtype), cfg["outlier_ratio"] * median)
        if v >= line:
            return "relative", "warning", line
    return None


def _why(rule: str, v: float, units: float, ratio: float | None, median: float | None, peers: int,
         dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if rule == "nonfinite":
        return "its own code turns finite inputs into inf/NaN"
    if rule == "absolute":
        warn_u = settings()["calibration"]["divergence_warning_u"]
        return f"{units:.0f} unit roundoffs of {name}, past the {warn_u} u line the dtype's rounding explains"
    return (f"{ratio:.0f}x the median own error ({median:.2g}) of the model's {peers} modules in {name}, "
            f"though under the {settings()['calibration']['divergence_warning_u']} u line")


def _rounding_explains(v: float, lost: float | None, fed_inf: bool) -> bool:
    """Whether rounding alone explains own error ``v``: ``lost`` (what rounding loses around the module, None: not
    measured) at least ``v`` / ``rounding_explains``; for a non-finite ``v``, inputs already inf in the dtype
    (``fed_inf``) or at least ``rounding_total`` of the tensor lost (flushed to zero)."""
    cfg = settings()["attribution"]
    if lost is not None and not math.isfinite(lost):
        lost = None      # no ratio to it: inputs already inf are fed_inf's case, an exact answer inf in FP32 none
    if math.isfinite(v):
        return lost is not None and v <= float(cfg["rounding_explains"]) * lost
    return fed_inf or (lost is not None and lost >= float(cfg["rounding_total"]))


def culprits(own: Mapping[str, float | None], dtype: torch.dtype | str | None, *,
             inherited: bool = False, rounding: Mapping[str, float | None] | None = None,
             fed_inf: Iterable[str] = (), unstable: Iterable[str] = ()) -> list[Culprit]:
    """The flagged modules of ``own`` (module -> own error; None: not measured), worst first.
    ``inherited``: the values accumulate from the input on (scope ``global``); ``rounding``: module -> what
    rounding alone loses around it (:func:`rounding_around`), ``fed_inf``: the modules whose inputs were inf or
    NaN in the dtype before they ran (:func:`fed_nonfinite`), for the excuses the module docstring describes;
    ``unstable``: modules whose FP32 output FP32's own rounding already moves past the line
    (:func:`fp32_unstable`): no reference to judge a finite own error against."""
    fed_inf, unstable = set(fed_inf), set(unstable)
    dtype = low_dtype(dtype)
    u = unit_roundoff(dtype)
    median, peers = peer_median(own)
    judged: dict[str, tuple[float, tuple[str, str, float]]] = {}
    for name, v in own.items():
        if v is None or _rounding_explains(v, (rounding or {}).get(name), name in fed_inf) \
                or (name in unstable and math.isfinite(v)):
            continue
        verdict = _verdict(v, dtype, median)
        if verdict is not None:
            judged[name] = (v, verdict)

    def explained(name: str) -> bool:
        v = judged[name][0]
        return any(_is_below(name, other) and (inherited or not math.isfinite(w))
                   for other, (w, _) in judged.items()) and (inherited or not math.isfinite(v))

    kept = [n for n in judged if not explained(n)]
    # Non-finite first (NaN, the worst a comparison gets, then inf), then by size.
    kept.sort(key=lambda n: (0 if math.isnan(judged[n][0]) else 1, -judged[n][0]
                             if not math.isnan(judged[n][0]) else 0.0))
    out = []
    for rank, name in enumerate(kept, 1):
        v, (rule, severity, line) = judged[name]
        units = v / u if math.isfinite(v) else math.inf
        ratio = v / median if median and math.isfinite(v) else None
        out.append(Culprit(name, v, units, ratio, median, peers, rule, severity, line, rank,
                           _why(rule, v, units, ratio, median, peers, dtype)))
    return out


def rounding_around(row: Mapping) -> float | None:
    """What rounding alone loses around a module: its inputs' rounding plus its output's storage (relative L2s
    of a local divergence row, prefixed ``local_`` in calibration's rows); None when neither was measured."""
    parts = [row.get(k, row.get("local_" + k)) for k in ("input_rel_l2", "output_rel_l2")]
    parts = [p for p in parts if p is not None]
    return sum(parts) if parts else None


def fed_nonfinite(row: Mapping) -> bool:
    """Whether a module's inputs (a composite's children's outputs included) were already inf or NaN when rounded
    to their real dtypes (``input_rel_l2`` of a local divergence row, ``local_`` in calibration's, non-finite)."""
    lost = row.get("input_rel_l2", row.get("local_input_rel_l2"))
    return lost is not None and not math.isfinite(lost)


def zero_reference(row: Mapping) -> bool:
    """Whether a module's own error is inf only because its FP32 answer is all zero: the relative L2 divides by a
    zero reference while the low-precision output differs from it by a finite amount (``max_abs`` of a local
    divergence row, ``local_`` in calibration's). A LayerNorm over one feature gives exactly 0 in FP32 and a
    residue of rounding in bf16: no reference to be relative to, not an inf/NaN its code makes."""
    own = row.get("local_rel_l2", row.get("rel_l2"))
    diff = row.get("local_max_abs", row.get("max_abs"))
    return own == math.inf and diff is not None and math.isfinite(diff)


def excused_nonfinite(row: Mapping) -> bool:
    """Whether a non-finite own error in ``row`` is not the module's code: its inputs were already inf in the dtype
    (:func:`fed_nonfinite`) or its FP32 answer is all zero (:func:`zero_reference`). The modules ``culprits`` takes
    as ``fed_inf``, in ``check --calibrate`` and the report alike."""
    return fed_nonfinite(row) or zero_reference(row)


def fp32_unstable(row: Mapping, dtype: torch.dtype | str | None) -> bool:
    """Whether FP32's own rounding moves a module's FP32 output past the dtype's warning line: ``fp32_moved`` of a
    calibration row (:mod:`ampaudit.runtime.fp32_floor`, measured only for would-be culprits) at least that line."""
    moved = row.get("fp32_moved")
    return moved is not None and moved >= divergence_thresholds(low_dtype(dtype))[0]


def own_errors(order: list[str], modules: Mapping[str, Mapping]) -> tuple[dict[str, float | None], bool]:
    """(module -> the error it is judged by, whether those accumulate from the input on) of calibration rows: own
    errors where the probe measured them; the global ones, judged as inherited, when it measured none
    (calibration without local re-runs). A module whose re-run could not run (a note says why) has no own error
    and is not judged."""
    if any("local_rel_l2" in modules[n] for n in order):
        return {n: modules[n].get("local_rel_l2") for n in order}, False
    return {n: modules[n].get("rel_l2") for n in order}, True


def calibration_culprits(order: list[str], modules: Mapping[str, Mapping],
                         dtype: torch.dtype | str | None) -> list[Culprit]:
    """:func:`culprits` of calibration rows (``cal.order``, ``cal.modules``), with every excuse the rows hold: the
    verdict of ``check --calibrate``'s AMP701."""
    own, inherited = own_errors(order, modules)
    return culprits(own, dtype, inherited=inherited, rounding={n: rounding_around(modules[n]) for n in order},
                    fed_inf=[n for n in order if excused_nonfinite(modules[n])],
                    unstable=[n for n in order if fp32_unstable(modules[n], dtype)])


def crosses(culprit: Culprit, value: float | None) -> bool:
    """Whether one measurement of the culprit's own error is past the line that flagged it (NaN is)."""
    return value is not None and not (value < culprit.line)


def first_crossing(found: list[Culprit], events: Iterable[tuple[str, int | None, float | None]]) -> dict | None:
    """Where the error first shows: the first of ``events`` ((module, step, own rel_l2) in the order they were
    measured, innermost module first within a check) that is a culprit's and past its line."""
    by_name = {c.module: c for c in found}
    for module, step, value in events:
        c = by_name.get(module)
        if c is not None and crosses(c, value):
            return {"module": module, "step": step, "rel_l2": value, "rule": c.rule}
    return None
