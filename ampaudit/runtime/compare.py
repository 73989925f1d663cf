"""One batch, offline: each module's output under autocast against an FP32 forward (what ``check --calibrate``
measures), built on the watch's :class:`~ampaudit.runtime.divergence.DivergenceProbe`.

    rows = compare_to_fp32(model, (x,), {}, dtype=torch.float16)
    # [{"module": "mlp.fc", "rel_l2": 3e-4, "cosine": 0.99999, "max_abs": 0.002, "sqnr_db": 70.1,
    #   "local_rel_l2": ..., "absmax": 12.5, "headroom_bits": 12.3, "underflow_share": 0.0, ...}, ...]
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ampaudit.runtime.divergence import METRICS, DivergenceProbe
from ampaudit.runtime.replay_state import preserved
from ampaudit.wrappers import unwrap


def compare_to_fp32(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
                    dtype: torch.dtype = torch.float16, device_type: str = "cpu",
                    local: bool = True) -> list[dict]:
    """One forward under ``torch.autocast(device_type, dtype)`` against an FP32 forward, per module.

    Returns one row per module in execution order: ``module``; global ``rel_l2``, ``cosine``, ``max_abs``,
    ``sqnr_db``; the same prefixed ``local_`` (the module's own error: alone on its inputs as the autocast run had
    them, a composite, the root included, with the submodules it calls computed in FP32) and ``local_input_rel_l2``
    (what rounding its inputs to their real dtypes lost, where it changed them), ``local_output_rel_l2`` (what
    storing the FP32 answer in its output dtype loses); and from the FP32 reference outputs ``absmax``, ``headroom_bits`` (log2(dtype max / absmax)), ``overflow``
    (values above the dtype's max), ``underflow_share`` (share of nonzero values below its smallest normal)
    and ``flush_share`` (share that would round to zero). Buffers and RNG are left as they were.
    """
    root = unwrap(model)
    probe = DivergenceProbe(root, device_type=device_type, dtype=dtype, local=local, ranges=True)
    if not probe.usable:
        return []
    args, kwargs = tuple(args), dict(kwargs or {})
    rng = {"cpu": torch.get_rng_state()}
    try:
        with preserved(root, rng):
            probe.begin(capture_grads=False)
            with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
                root(*args, **kwargs)
        probe.shadow(args, kwargs, rng_state=rng, grad=False)
        events = probe.events()
    finally:
        probe.close()
    rows: dict[str, dict] = {}
    for ev in events:
        if ev.get("call"):
            continue
        row = rows.setdefault(ev["module"], {"module": ev["module"]})
        prefix = "" if ev["scope"] == "global" else "local_"
        for m in METRICS:
            row[prefix + m] = ev[m]
        for key in ("input_rel_l2", "output_rel_l2"):
            if key in ev:
                row["local_" + key] = ev[key]
    for name, r in probe.ranges_by_module().items():
        rows.setdefault(name, {"module": name}).update(r)
    return list(rows.values())
