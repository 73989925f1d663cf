"""Whether FP32 itself determines a module's output: an own error measured against FP32 means nothing where not.

    moved = fp32_moved(model, args, kwargs, ["backbone.pos_net.0.norm1"])   # {"backbone.pos_net.0.norm1": 0.93}

Each named module is run alone in FP32, twice, on the FP32 inputs it received in one FP32 forward of the model: as
received, and with every floating input element moved to its FP32 neighbour (one unit in the last place, up or
down at random). The value is the relative L2 between the two outputs. A healthy module moves by about its
condition number times 2^-24. A GroupNorm fed a signal that is constant over what it normalises (wavtokenizer's
decoder on an untrained, all-zero codebook: every frame decodes to the same vector) outputs its own rounding
residue amplified by 1/sqrt(eps), in FP32 as in fp16: its output moves by ~100%, and a 100% own error against such
a reference is one noise measured against another, not the low dtype's doing.

``check --calibrate`` and the watch's divergence checks with own errors (:func:`mark_local_rows`, the trace's
``fp32_moved``) measure this only for the modules the divergence verdict would otherwise flag (nothing runs for a
model without such modules); :func:`ampaudit.runtime.attribution.culprits` leaves out a module FP32's own
rounding already moves past the verdict's line, in both paths, and ``check`` says so in a note.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ampaudit.runtime.fp32 import ieee_fp32, upcast
from ampaudit.runtime.metric_batch import finish_metrics, metric_sums
from ampaudit.runtime.replay_state import capture_rng, float_tensors, preserved, rng_replayed


def _detached_copy(tree: Any) -> Any:
    # The inputs as the module received them: a later in-place op of the forward must not change them.
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _moved(tree: Any, gen: torch.Generator) -> Any:
    def one(t):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel()):
            return t
        up = torch.rand(t.shape, generator=gen) < 0.5
        toward = torch.where(up.to(t.device), torch.tensor(math.inf, device=t.device),
                             torch.tensor(-math.inf, device=t.device))
        return torch.nextafter(t, toward)
    return tree_map(one, tree)


def _rel_l2(ref: list[torch.Tensor], other: list[torch.Tensor]) -> float | None:
    # The divergence probe's own metric (sampled the same way), so the value is comparable with its line.
    if not ref or not all(bool(torch.isfinite(a).all()) for a in ref):
        return None        # no finite reference to be relative to: other verdicts judge non-finite values
    sums = metric_sums(list(zip(other, ref)))
    return None if sums is None else finish_metrics(sums.tolist())["rel_l2"]


def fp32_moved(model: nn.Module, args: tuple, kwargs: dict, names: Iterable[str], *,
               seed: int = 0) -> dict[str, float]:
    """module name -> relative L2 by which its FP32 output moves when its FP32 inputs move by one unit in the last
    place (see the module docstring), for the modules of ``names`` that one FP32 forward on ``args``/``kwargs``
    calls (their first call). Model state and RNG are left as they were; a module that cannot be re-run alone
    (or has no finite output) is left out."""
    names = set(names)
    wanted = {mod: name for name, mod in model.named_modules() if name in names}
    received: dict[str, tuple[nn.Module, Any, Any, torch.Tensor]] = {}

    def pre(mod, a, k):
        name = wanted.get(mod)
        if name is not None and name not in received:
            received[name] = (mod, _detached_copy(a), _detached_copy(k), torch.get_rng_state())

    handles = [mod.register_forward_pre_hook(pre, with_kwargs=True) for mod in wanted]
    a32, k32 = upcast(tuple(args)), upcast(dict(kwargs))
    try:
        with preserved(model, capture_rng(float_tensors((a32, k32)))), torch.no_grad(), ieee_fp32():
            model(*a32, **k32)
    finally:
        for h in handles:
            h.remove()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, float] = {}
    for name, (mod, a, k, rng) in received.items():
        try:
            with preserved(model, None), torch.no_grad(), ieee_fp32():
                with rng_replayed({"cpu": rng}):
                    ref = float_tensors(mod.forward(*a, **k))
                with rng_replayed({"cpu": rng}):
                    other = float_tensors(mod.forward(*_moved(a, gen), **_moved(k, gen)))
        except Exception:  # noqa: BLE001 - a module that cannot run alone is judged as before
            continue
        value = _rel_l2(ref, other)
        if value is not None:
            out[name] = value
    return out


def mark_local_rows(root: nn.Module, args: tuple, kwargs: dict, rows: list[dict], dtype: torch.dtype) -> None:
    """Add ``fp32_moved`` to the scope-``local`` divergence rows (one check's events) of the modules the own-error
    verdict would flag among them, measured on this pass's ``args``/``kwargs``. Not in a run of several ranks:
    each rank would pick its modules alone, and a forward some ranks run and others do not stalls FSDP's and
    DDP's collectives."""
    from ampaudit.runtime.attribution import culprits, excused_nonfinite, rounding_around

    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return
    local = [r for r in rows if r.get("scope") == "local" and not r.get("call")]
    own = {r["module"]: r.get("rel_l2") for r in local}
    found = culprits(own, dtype, rounding={r["module"]: rounding_around(r) for r in local},
                     fed_inf=[r["module"] for r in local if excused_nonfinite(r)])
    names = [c.module for c in found if c.rule != "nonfinite"]
    if not names:
        return
    try:
        moved = fp32_moved(root, args, kwargs, names)
    except Exception:  # noqa: BLE001 - the check's own rows stand; its modules are judged as without this
        return
    for r in local:
        if r["module"] in moved:
            r["fp32_moved"] = moved[r["module"]]
