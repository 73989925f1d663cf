"""Evaluation under autocast and in FP32, side by side: the same weights, eval mode, no gradients.

A model trained under AMP is usually validated under AMP too, and fp16 evaluation can differ from FP32 (top-1 by
0.1%, top-5 by 0.5% on ImageNet classifiers): numbers reported from it are not the model's. Every ``every`` steps
the trainer runs ``eval_data()`` twice through the model, once under the run's autocast and once in FP32, and
writes one ``eval`` event (trace version 2) with both losses, both metrics and their gaps:

    evaluator = Evaluator(eval_data, loss_fn, metric_fn=None, every=100, dtype=torch.float16, device=device)
    if evaluator.due(step):
        result = evaluator.run(model, step, masters=None)
    # {"dtype": "float16", "batches": 8, "samples": 256, "time": 0.4,
    #  "loss": {"autocast": 0.52, "fp32": 0.50, "gap": 0.02, "noise": 0.004},
    #  "metrics": {"top1": {"autocast": 0.91, "fp32": 0.93, "gap": -0.02, "noise": 0.01}, ...}}

``metric_fn(output, target) -> dict`` of numbers, from the model file, gives the metrics; without it, outputs of
shape (N, C, ...) with integer class-index targets of shape (N, ...) get ``top1`` (and ``top5`` when C > 5). Each
value is the sample-weighted mean over the eval batches; ``noise`` is the standard error of the FP32 value over
those batches (None with one batch), what ``ampaudit report`` weighs the gap against. Under O2 the FP32 pass runs
the model's own forward on its FP32 master weights (``torch.func.functional_call``; buffers as float), so nothing is
copied or cast in place. The RNG states are restored after evaluating, so a run with evaluation trains exactly as
one without.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ampaudit.dtypes import name_of
from ampaudit.errors import TrainError, UsageError
from ampaudit.runtime.replay_state import rng_snapshot
from ampaudit.train.data import as_factory, split_batch
from ampaudit.train.data import batch_size

PASSES = ("autocast", "fp32")


def topk_metrics(output: Any, target: Any) -> dict[str, float] | None:
    """Top-1 (and top-5 when there are more than 5 classes) accuracy of class scores against class indices, or
    None when ``output``/``target`` are not that (a regression, a dict output)."""
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if not output.is_floating_point() or target.is_floating_point() or target.dtype == torch.bool:
        return None
    if output.dim() < 2 or output.dim() != target.dim() + 1 or output.shape[0] != target.shape[0] \
            or output.shape[2:] != target.shape[1:]:
        return None
    scores = output.float().movedim(1, -1).reshape(-1, output.shape[1])
    labels = target.reshape(-1)
    classes = scores.shape[1]
    out = {}
    for k in (1, 5):
        if k == 1 or classes > k:
            top = scores.topk(k, dim=1).indices
            out[f"top{k}"] = float((top == labels[:, None]).any(dim=1).float().mean())
    return out


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TrainError(f"metric_fn returned {type(value).__name__} for {name!r}, not a number",
                     hint="return a dict of floats or 0-d tensors, e.g. {'acc': (out.argmax(1) == y).float().mean()}")


def _combine(values: list[float], weights: list[int]) -> tuple[float, float | None]:
    """Sample-weighted mean and its standard error over the batches (None for one batch)."""
    total = sum(weights)
    mean = sum(v * w for v, w in zip(values, weights)) / total
    if len(values) < 2 or not math.isfinite(mean):
        return mean, None
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / total
    return mean, math.sqrt(var / (len(values) - 1))


def describe_result(result: dict[str, Any]) -> str:
    """One line for people: ``eval at step 20 (float16 | fp32): loss 0.512 | 0.498 (gap +0.014); top1 ...``."""
    parts = []
    for name, q in [("loss", result["loss"]), *result["metrics"].items()]:
        parts.append(f"{name} {q['autocast']:.4g} | {q['fp32']:.4g} (gap {q['gap']:+.3g})")
    return f"eval at step {result['step']} ({result['dtype']} | fp32): " + "; ".join(parts)


class Evaluator:
    """Evaluates a model under autocast and in FP32 every ``every`` steps; see the module docstring."""

    def __init__(self, eval_data: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *, every: int,
                 dtype: torch.dtype, device: torch.device, metric_fn: Callable[[Any, Any], dict] | None = None):
        if every is None or every < 1:
            raise UsageError(f"eval_every must be >= 1, got {every}", hint="e.g. eval_every=500")
        if dtype == torch.float32:
            raise UsageError("evaluation compares autocast with FP32, and this run trains in float32",
                             hint="drop eval_every, or train in float16/bfloat16")
        if eval_data is None:
            raise UsageError("evaluation needs eval_data", hint="add def eval_data(): yield inputs, target "
                                                                "to the model file (or pass eval_data=)")
        self._factory = as_factory(eval_data)
        self._loss_fn, self._metric_fn = loss_fn, metric_fn
        self.every, self.dtype, self.device = every, dtype, device
        self.results: list[dict[str, Any]] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, model: nn.Module, step: int, *, masters: Any = None) -> dict[str, Any]:
        """Evaluate ``model`` (O2: ``masters`` hold its FP32 weights); return the ``eval`` event's fields."""
        t0 = time.perf_counter()
        restore_rng = rng_snapshot()     # eval_data may draw from the global generators; training must not notice
        modes = [(m, m.training) for m in model.modules()]
        fp32_state = None if masters is None else self._fp32_state(model, masters)
        try:
            model.eval()
            per_batch: dict[str, dict[str, list[float]]] = {}
            weights: list[int] = []
            with torch.no_grad():
                for i, batch in enumerate(self._factory()):
                    args, kwargs, target = split_batch(batch, self.device)
                    weights.append(batch_size(batch))
                    for name, state, autocast in (("autocast", None, True), ("fp32", fp32_state, False)):
                        measured = self._measure(model, state, args, kwargs, target, autocast, step, i)
                        for key, value in measured.items():
                            per_batch.setdefault(key, {p: [] for p in PASSES})[name].append(value)
        finally:
            for m, training in modes:
                m.training = training
            restore_rng()
        if not weights:
            raise TrainError("eval_data() yielded no batches", hint="make it yield (inputs, target) pairs")
        result: dict[str, Any] = {"dtype": name_of(self.dtype), "batches": len(weights), "samples": sum(weights)}
        quantities = {}
        for key, by_pass in per_batch.items():
            if len(by_pass["autocast"]) != len(weights) or len(by_pass["fp32"]) != len(weights):
                raise TrainError(f"metric_fn returned {key!r} for some eval batches only",
                                 hint="return the same keys for every batch")
            amp, _ = _combine(by_pass["autocast"], weights)
            fp32, noise = _combine(by_pass["fp32"], weights)
            quantities[key] = {"autocast": amp, "fp32": fp32, "gap": amp - fp32, "noise": noise}
        result["loss"] = quantities.pop("loss")
        result["metrics"] = quantities
        result["time"] = time.perf_counter() - t0
        self.results.append({"step": step, **result})
        return result

    def _measure(self, model: nn.Module, state: dict | None, args: tuple, kwargs: dict, target: Any,
                 autocast: bool, step: int, index: int) -> dict[str, float]:
        try:
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=autocast):
                if state is None:
                    output = model(*args, **kwargs)
                else:
                    output = torch.func.functional_call(model, state, args, kwargs)
                loss = self._loss_fn(output, target)
            metrics = self._metric_fn(output, target) if self._metric_fn is not None else \
                (topk_metrics(output, target) or {})
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
            from ampaudit.machine.kernels import run_gap

            gap = run_gap(exc, self.device.type, self.dtype if autocast else None)
            if gap is not None:    # this CPU lacks a kernel: eval_data() and metric_fn are not at fault
                raise TrainError(f"{gap[0]} (evaluation at step {step}, eval batch {index}: "
                                 f"{' '.join(str(exc).split())[:160]})", hint=gap[1]) from exc
            raise TrainError(f"evaluation failed at step {step} (eval batch {index}): {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:240]}",
                             hint="check that eval_data() yields what forward(), loss_fn() and metric_fn() take") \
                from exc
        if not isinstance(metrics, dict):
            raise TrainError(f"metric_fn must return a dict of numbers, got {type(metrics).__name__}",
                             hint="e.g. return {'acc': (output.argmax(1) == target).float().mean()}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TrainError("loss_fn must return a scalar tensor on eval batches too", hint="reduce it, e.g. .mean()")
        out = {"loss": float(loss.detach().float())}
        for name, value in metrics.items():
            if str(name) == "loss":
                raise TrainError("metric_fn returned a metric named 'loss'; the loss is evaluated already",
                                 hint="name it differently")
            out[str(name)] = _number(str(name), value)
        return out

    @staticmethod
    def _fp32_state(model: nn.Module, masters: Any) -> dict[str, torch.Tensor]:
        """An O2 model's tensors for an FP32 forward: the FP32 masters (not their rounding), and every other float
        parameter and buffer as float."""
        state = {n: t.detach().float() if t.is_floating_point() else t
                 for n, t in [*model.named_parameters(), *model.named_buffers()]}
        state.update({n: m.detach() for n, m in masters.named_parameters()})
        return state


__all__ = ["Evaluator", "describe_result", "topk_metrics"]
