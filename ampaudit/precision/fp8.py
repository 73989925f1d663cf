"""torchao's float8 training, imported quietly, and what its dynamic-scale cast does to one tensor.

    ao = import_torchao()                       # torchao.float8, or a UsageError naming the fp8 extra
    cfg = config("rowwise")                     # torchao's Float8LinearConfig for the recipe, emulated
    cast_stats(x, dtype=torch.float8_e4m3fn, granularity="axiswise", round_scales_to_power_of_2=True)
    # {"amax": 12.5, "flushed_share": 0.0, "clipped_share": 0.0, "dynamic_range_bits": 14.2,
    #  "subnormal_share": 0.003}

What torchao 0.18 does per recipe (``Float8LinearConfig.from_recipe_name``):

- ``tensorwise``: one scale per tensor; input and weight in e4m3 (max 448), grad_output in e5m2 (max 57344,
  two more exponent bits for gradients, one mantissa bit fewer); scales are not rounded.
- ``rowwise``: one scale per row along the GEMM's reduction dim (axiswise), e4m3 for input, weight *and*
  grad_output; scales rounded down to a power of two. Each operand is cast once per GEMM it feeds, along that
  GEMM's reduction dim: input along K for the output and along M (tokens) for grad_weight, grad_output along N
  for grad_input and along M for grad_weight.
- ``rowwise_with_gw_hp``: rowwise for the output and grad_input GEMMs (the weight tensorwise for grad_input), and
  the grad_weight GEMM left in high precision (its casts disabled).

The statistics say *why* a layer loses accuracy in float8: one outlier sets the scale of every value that
shares it, and the rest land in the subnormals or flush to zero (LLM activations with a few huge features).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from types import ModuleType
from typing import Iterator

import torch

from ampaudit.dtypes import limits
from ampaudit.errors import UsageError
from ampaudit.quiet import debug

__all__ = ["RECIPES", "cast_stats", "config", "import_torchao"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
GRANULARITIES = ("tensorwise", "axiswise")

# What importing torchao prints on a CPU build, by logger: its CUDA extensions that cannot load here, and
# torch's pytree deprecation of register_constant() on an Enum, which torchao still calls. Exactly these are
# dropped; anything else those loggers say during the import still shows.
_IMPORT_CHATTER = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropChatter(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(s in message for s in self.starts)


@contextlib.contextmanager
def _import_chatter_dropped() -> Iterator[None]:
    # A logger's own filters see the records it creates (not its children's), so each filter drops only
    # the one message of that one module.
    filters = [(logging.getLogger(name), _DropChatter(starts)) for name, starts in _IMPORT_CHATTER.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def import_torchao() -> ModuleType:
    """``torchao.float8``, imported without its CPU-build chatter (``AMPAUDIT_DEBUG=1`` shows it); a
    :class:`UsageError` naming the ``fp8`` extra when torchao is not installed."""
    try:
        with contextlib.nullcontext() if debug() else _import_chatter_dropped():
            import torchao.float8 as float8
    except ImportError as exc:
        raise UsageError("ampaudit plan needs torchao", hint="pip install 'ampaudit[fp8]'") from exc
    return float8


def config(recipe: str, *, emulate: bool = True):
    """torchao's ``Float8LinearConfig`` for ``recipe`` (one of :data:`RECIPES`); ``emulate=True`` runs the
    float8 GEMMs as dequantize-then-fp32-matmul, which works on any device (CPU included)."""
    if recipe not in RECIPES:
        raise UsageError(f"unknown float8 recipe {recipe!r}", hint=f"use one of {', '.join(RECIPES)}")
    float8 = import_torchao()
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=emulate) if cfg.emulate != emulate else cfg


def _granularity(granularity):
    from torchao.float8.config import ScalingGranularity

    if isinstance(granularity, ScalingGranularity):
        return granularity
    name = {"rowwise": "axiswise"}.get(granularity, granularity)
    if name not in GRANULARITIES:
        raise UsageError(f"unknown float8 scaling granularity {granularity!r}",
                         hint=f"use one of {', '.join(GRANULARITIES)}")
    return ScalingGranularity(name)


def cast_stats(t: torch.Tensor, *, dtype: torch.dtype, granularity="tensorwise",
               round_scales_to_power_of_2: bool = False, axiswise_dim: int = -1) -> dict[str, float]:
    """What casting ``t`` to float8 ``dtype`` with torchao's dynamic scale does to its values.

    ``granularity``: "tensorwise" (one scale), "axiswise" (alias "rowwise": one scale per slice along
    ``axiswise_dim``, the reduction dim of the GEMM the cast feeds) or a torchao ``ScalingGranularity``.
    Shares are of the finite nonzero values of ``t``: ``flushed_share`` become 0, ``clipped_share`` saturate
    at the format's max (beyond its rounding interval), ``subnormal_share`` land below its smallest normal.
    ``dynamic_range_bits`` is log2(amax / smallest nonzero |x|) over the whole tensor; ``amax`` is max |x|;
    ``scale`` is torchao's scale (the smallest one of an axiswise cast).
    """
    import_torchao()
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    g = _granularity(granularity)
    x = t.detach().float()
    magnitude = x.abs()
    counted = (magnitude > 0) & torch.isfinite(x)
    n = int(counted.sum())
    scale = tensor_to_scale(x, dtype, scaling_granularity=g,
                            axiswise_dim=axiswise_dim if g.value == "axiswise" else None,
                            round_scales_to_power_of_2=round_scales_to_power_of_2)
    smallest_scale = float(scale.min())
    if n == 0:
        amax = float(magnitude.max()) if x.numel() else 0.0
        return {"amax": amax, "scale": smallest_scale, "flushed_share": 0.0, "clipped_share": 0.0,
                "dynamic_range_bits": 0.0, "subnormal_share": 0.0}
    # Exactly torchao's cast (_ToFloat8ConstrFunc): fp32 multiply by the scale, then a saturated cast.
    scaled = x * scale
    q = to_fp8_saturated(scaled, dtype).float()
    info = limits(dtype)
    amax = float(magnitude.max())
    # Values within half an ulp above max round to max anyway; only those beyond were clipped by saturation.
    clip_at = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2
    q_mag = q.abs()
    flushed = int((counted & (q_mag == 0)).sum())
    clipped = int((counted & (scaled.abs() > clip_at)).sum())
    subnormal = int((counted & (q_mag > 0) & (q_mag < info.normal)).sum())
    smallest = float(magnitude[counted].min())
    finite_max = float(magnitude[counted].max())
    return {"amax": amax, "scale": smallest_scale, "flushed_share": flushed / n, "clipped_share": clipped / n,
            "dynamic_range_bits": math.log2(finite_max / smallest), "subnormal_share": subnormal / n}
