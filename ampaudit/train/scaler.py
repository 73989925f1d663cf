"""Dynamic loss scaling: a policy around ``torch.amp.GradScaler``.

``GradScaler`` does the kernels (scaling the loss, unscaling with the fused inf/NaN check, skipping the optimizer
step on overflow). :class:`LossScaler` decides what the scale becomes and when training must stop, closing the gaps
users hit with the bare scaler: the scale is clamped to ``[min_scale, max_scale]`` (GradScaler can fall below 1 and
decay towards 0), ``hysteresis`` tolerates a few overflows before backing off (as Megatron and DeepSpeed do), a run
that keeps skipping is halted instead of silently training nothing, and ``state_dict`` carries every tracker so a
resumed run continues with the scale it had, not 65536.

    scaler = LossScaler("cpu", max_consecutive_skips=20)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)             # once per optimizer step, before clipping
    stepped = scaler.step(optimizer)       # False: non-finite gradients, step skipped
    scaler.update()
    if scaler.halt_reason(): ...

A disabled scaler (``enabled=False``, for bf16 or fp32) passes everything through and never skips.
"""
from __future__ import annotations

import collections
import math
from typing import Any

import torch

from ampaudit.errors import TrainError, UsageError

SCALER_STATE_VERSION = 1


class LossScaler:
    """Loss-scale policy: growth, backoff, hysteresis, min/max clamp and halt detection on top of GradScaler.

    ``dynamic=False`` keeps ``init_scale`` fixed (a static loss scale) while still skipping overflowing steps.
    A halt is reported by :meth:`halt_reason` once ``max_consecutive_skips`` steps in a row were skipped, or
    (when ``max_skip_fraction`` is set) once that fraction of the last ``skip_window`` steps were.
    """

    def __init__(self, device: str = "cpu", *, enabled: bool = True, dynamic: bool = True,
                 init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24, max_consecutive_skips: int | None = 50,
                 skip_window: int = 100, max_skip_fraction: float | None = None, history: int = 200):
        _check_policy(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                      max_scale, max_consecutive_skips, skip_window, max_skip_fraction)
        self.enabled = enabled
        self.dynamic = dynamic
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.max_consecutive_skips = max_consecutive_skips
        self.skip_window = skip_window
        self.max_skip_fraction = max_skip_fraction
        init = min(max(float(init_scale), min_scale), max_scale) if dynamic else float(init_scale)
        # GradScaler's own growth/backoff is bypassed: every update hands it the scale this policy chose.
        self._scaler = torch.amp.GradScaler(device, init_scale=init, growth_factor=growth_factor,
                                            backoff_factor=backoff_factor, growth_interval=growth_interval,
                                            enabled=enabled)
        self.init_scale = init
        self._scale = init
        self._found_inf: bool | None = None
        self.steps = 0
        self.growth_tracker = 0
        self.hysteresis_left = hysteresis
        self.consecutive_skips = 0
        self.total_skips = 0
        self.window: collections.deque[bool] = collections.deque(maxlen=skip_window)
        self.history: collections.deque[dict] = collections.deque(maxlen=history)

    # -- the four calls of an optimizer step -------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, in fp32: an fp16 loss times 65536 would itself overflow."""
        if not self.enabled:
            return loss
        return self._scaler.scale(loss.float())

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place and record whether any is inf/NaN. Once per step."""
        if not self.enabled:
            return
        try:
            self._scaler.unscale_(optimizer)
        except RuntimeError as exc:
            raise TrainError(f"loss scaler: {exc}",
                             hint="unscale_ runs once per optimizer step, after the last micro-batch") from exc
        except ValueError as exc:  # "Attempting to unscale FP16 gradients."
            raise TrainError("the optimizer holds float16 parameters: their gradients cannot be unscaled",
                             hint="keep FP32 master weights (opt_level O2) or train an fp32 model (O1)") from exc

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` unless the gradients were non-finite; return whether it stepped."""
        if not self.enabled:
            optimizer.step()
            self._found_inf = False
            return True
        self._scaler.step(optimizer)
        # GradScaler.step already synced on this flag to decide; reading it again costs nothing more.
        found = self._scaler._found_inf_per_device(optimizer)
        self._found_inf = bool(sum(v.item() for v in found.values()))
        return not self._found_inf

    def update(self, step: int | None = None) -> None:
        """Apply the policy to the outcome of the last :meth:`step` and record it in the history."""
        skipped = bool(self._found_inf)
        self._found_inf = None
        self.steps += 1
        self.window.append(skipped)
        if skipped:
            self.consecutive_skips += 1
            self.total_skips += 1
        else:
            self.consecutive_skips = 0
        if self.enabled:
            if self.dynamic:
                self._scale = self._next_scale(skipped)
            self._scaler.update(new_scale=float(self._scale))
        self.history.append({"step": self.steps if step is None else step,
                             "scale": self.get_scale(), "skipped": skipped})

    def _next_scale(self, skipped: bool) -> float:
        if skipped:
            self.growth_tracker = 0
            # As in Megatron, the tolerance refills only when the scale grows: repeated overflows within a
            # growth interval each back off once the first `hysteresis` are used up.
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                # Stay at the floor rather than decaying to 0: a stuck run is caught by halt_reason().
                return max(self._scale * self.backoff_factor, self.min_scale)
            return self._scale
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_left = self.hysteresis
            return min(self._scale * self.growth_factor, self.max_scale)
        return self._scale

    # -- queries -----------------------------------------------------------------------------------------------
    def get_scale(self) -> float | None:
        """The current scale, or None when scaling is disabled."""
        return self._scale if self.enabled else None

    def halt_reason(self) -> str | None:
        """Why training should stop now (too many skipped steps), or None."""
        if self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
            floor = " (at its minimum)" if self.dynamic and self._scale <= self.min_scale else ""
            return (f"{self.consecutive_skips} consecutive optimizer steps skipped for non-finite gradients; "
                    f"loss scale {self._scale:g}{floor}")
        if self.max_skip_fraction is not None and len(self.window) == self.skip_window:
            frac = sum(self.window) / len(self.window)
            if frac >= self.max_skip_fraction:
                return (f"{frac:.0%} of the last {self.skip_window} optimizer steps skipped for non-finite "
                        f"gradients (limit {self.max_skip_fraction:.0%}); loss scale {self._scale:g}")
        return None

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every tracker (scale, growth, hysteresis, skip counters, window, history) as plain data."""
        return {"version": SCALER_STATE_VERSION, "enabled": self.enabled, "dynamic": self.dynamic,
                "scale": self._scale, "steps": self.steps, "growth_tracker": self.growth_tracker,
                "hysteresis_left": self.hysteresis_left, "consecutive_skips": self.consecutive_skips,
                "total_skips": self.total_skips, "window": list(self.window), "history": list(self.history),
                "grad_scaler": self._scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the trackers saved by :meth:`state_dict`; the policy (factors, limits) stays as configured."""
        if state.get("enabled") != self.enabled:
            was = "on" if state.get("enabled") else "off"
            raise TrainError(f"the checkpoint was trained with loss scaling {was}; this run has it "
                             f"{'on' if self.enabled else 'off'}",
                             hint="resume with the same dtype and loss_scale")
        self._scale = float(state["scale"])
        self.steps = int(state["steps"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        self.window.clear()
        self.window.extend(bool(v) for v in state["window"])
        self.history.clear()
        self.history.extend(state["history"])
        if self.enabled:
            saved = dict(state["grad_scaler"])
            saved.update(scale=self._scale, growth_factor=self.growth_factor,
                         backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)
            self._scaler.load_state_dict(saved)

    def config(self) -> dict[str, Any]:
        """The policy as plain data (for the trace's ``meta`` event)."""
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "dynamic": self.dynamic, "init_scale": self.init_scale,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "hysteresis": self.hysteresis,
                "min_scale": self.min_scale, "max_scale": self.max_scale,
                "max_consecutive_skips": self.max_consecutive_skips, "skip_window": self.skip_window,
                "max_skip_fraction": self.max_skip_fraction}

    def __repr__(self) -> str:
        if not self.enabled:
            return "LossScaler(enabled=False)"
        return (f"LossScaler(scale={self._scale:g}, dynamic={self.dynamic}, hysteresis={self.hysteresis}, "
                f"min={self.min_scale:g}, max={self.max_scale:g}, skipped={self.total_skips})")


def scaler_for(loss_scale: str | float, dtype: torch.dtype, device_type: str = "cpu", **policy: Any) -> LossScaler:
    """The scaler a ``--loss-scale`` value asks for: ``auto`` (dynamic for float16, none otherwise), ``dynamic``,
    ``none``, or a number (a static scale). ``policy`` goes to :class:`LossScaler` (ignored for ``none``)."""
    mode = str(loss_scale).lower()
    if mode == "auto":
        # bf16 has fp32's exponent range: gradients do not underflow, so it trains without a scaler.
        mode = "dynamic" if dtype == torch.float16 else "none"
    if mode == "none":
        return LossScaler(device_type, enabled=False)
    if mode == "dynamic":
        return LossScaler(device_type, **policy)
    try:
        static = float(mode)
    except ValueError:
        raise UsageError(f"bad loss scale {loss_scale!r}",
                         hint="use dynamic, none, auto, or a number such as 1024") from None
    return LossScaler(device_type, **{**policy, "dynamic": False, "init_scale": static})


def _check_policy(init_scale: float, growth: float, backoff: float, interval: int, hysteresis: int,
                  min_scale: float, max_scale: float, max_skips: int | None, window: int,
                  max_fraction: float | None) -> None:
    problems = []
    if not (math.isfinite(init_scale) and init_scale > 0):
        problems.append(f"init_scale must be a positive number, got {init_scale}")
    if not growth >= 1.0:
        problems.append(f"growth_factor must be >= 1, got {growth}")
    if not 0.0 < backoff < 1.0:
        problems.append(f"backoff_factor must be in (0, 1), got {backoff}")
    if interval < 1:
        problems.append(f"growth_interval must be >= 1, got {interval}")
    if hysteresis < 1:
        problems.append(f"hysteresis must be >= 1, got {hysteresis}")
    if not 0.0 < min_scale <= max_scale:
        problems.append(f"need 0 < min_scale <= max_scale, got {min_scale} and {max_scale}")
    if max_skips is not None and max_skips < 1:
        problems.append(f"max_consecutive_skips must be >= 1, got {max_skips}")
    if window < 1:
        problems.append(f"skip_window must be >= 1, got {window}")
    if max_fraction is not None and not 0.0 < max_fraction <= 1.0:
        problems.append(f"max_skip_fraction must be in (0, 1], got {max_fraction}")
    if problems:
        raise UsageError("bad loss-scaler policy: " + "; ".join(problems),
                         hint="give each of those parameters a value in its range")
