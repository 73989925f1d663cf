"""Import torchvision beside a CPU-only torch, whose C++ extension cannot load there.

    from coverage_tvops import import_torchvision
    tv, note = import_torchvision()      # note is None when torchvision's own extension loaded

The torchvision wheels on PyPI are CUDA builds: their ``_C.so`` links ``libtorch_cuda.so``, which a ``+cpu`` torch
does not ship, so the extension fails to load and ``import torchvision`` then dies registering a fake kernel for
``torchvision::nms`` (an op only the extension defines). This module defines the two ops the benchmark's
detection models need, ``nms`` and ``roi_align`` (and ``qnms``'s schema, so torchvision's fake registrations
succeed), with plain-PyTorch CPU kernels, then imports torchvision and tells it its ops exist. timm imports
torchvision, so call this before importing timm as well.
"""
from __future__ import annotations

import sys
from types import ModuleType

import torch

_LIB: torch.library.Library | None = None   # kept alive: the op definitions die with the Library object


def _nms_cpu(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    # Greedy NMS in score order, as torchvision's kernel: a box survives unless a kept, higher-scoring box
    # overlaps it by more than the threshold. One pass over an upper-triangular IoU mask.
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = scores.argsort(descending=True)
    boxes = dets[order].float()
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    lt = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    rb = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=2)
    iou = inter / (area[:, None] + area[None, :] - inter).clamp(min=1e-12)
    over = (iou > iou_threshold).triu(diagonal=1)
    removed = torch.zeros(len(boxes), dtype=torch.bool)
    keep = []
    for i in range(len(boxes)):
        if removed[i]:
            continue
        keep.append(i)
        removed |= over[i]
    return order[torch.tensor(keep, dtype=torch.long, device=dets.device)]


def _roi_align_cpu(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    # torchvision's own plain-PyTorch roi_align, without the torch.compile wrapper it carries (compiling it
    # costs ~20 s per process, more than the models it serves).
    ra = sys.modules["torchvision.ops.roi_align"]   # the module; torchvision.ops.roi_align is the function
    fn = getattr(ra._roi_align, "__wrapped__", ra._roi_align)
    return fn(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


def _roi_align_meta(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return input.new_empty((rois.size(0), input.size(1), pooled_height, pooled_width))


def _define_ops() -> None:
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", _nms_cpu, "CPU")
    lib.define("roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
               "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor")
    lib.impl("roi_align", _roi_align_cpu, "CPU")
    lib.impl("roi_align", _roi_align_meta, "Meta")
    _LIB = lib


def _forget_partial_import() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def import_torchvision() -> tuple[ModuleType, str | None]:
    """Import torchvision, with the plain-PyTorch ``nms`` when its extension cannot load; returns (module, note)."""
    if "torchvision" in sys.modules and _LIB is not None:
        return sys.modules["torchvision"], "torchvision C++ extension missing; nms in plain PyTorch"
    try:
        import torchvision
        return torchvision, None
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    _forget_partial_import()
    _define_ops()
    import torchvision
    import torchvision.extension

    # _assert_has_ops reads extension._has_ops at call time; roi_align's module bound its own copy at import.
    torchvision.extension._has_ops = lambda: True
    sys.modules["torchvision.ops.roi_align"]._has_ops = lambda: True
    return torchvision, "torchvision C++ extension missing; nms in plain PyTorch"
