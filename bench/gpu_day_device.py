"""The device bench/gpu_day.py measures on: the real GPU, or, in tests, a CPU that stands in for it.

    dev = cuda_device()                 # None without CUDA: every part then says "skipped: no CUDA"
    with dev.autocast(torch.bfloat16):  # CUDA autocast on the GPU
        y = model(dev.put(x))
    dev.sync(); dev.peak_bytes()

    sim = simulated_cuda()              # CPU tensors, CPU autocast with CUDA's policy (ampaudit.simulate): what
                                        # every CPU-side claim is; a part run on it tests its own plumbing

Everything a part does with the device goes through here, so the GPU run swaps in real CUDA numbers and
nothing else.
"""
from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ampaudit.dtypes import name_of
from ampaudit.policy import Policy
from ampaudit.simulate import target_autocast


@dataclass
class Device:
    """``type``: the torch device type the tensors live on; ``simulated``: CPU autocast follows CUDA's policy
    (the CPU simulation) instead of being the device's own autocast."""

    type: str
    name: str
    simulated: bool = False
    sync: Callable[[], None] = lambda: None
    reset_peak: Callable[[], None] = lambda: None
    peak_bytes: Callable[[], int | None] = lambda: None

    def put(self, value: Any) -> Any:
        """``value`` (tensors, modules, or containers of tensors) on this device. A module's plain tensor
        attributes move too: ``Module.to`` moves parameters and buffers only, and torch.fx keeps a traced
        constant (``_tensor_constant0``) as a plain attribute."""
        if isinstance(value, torch.nn.Module):
            value = value.to(self.type)
            for mod in value.modules():
                for name, attr in list(vars(mod).items()):
                    if isinstance(attr, torch.Tensor):
                        setattr(mod, name, attr.to(self.type))
            return value
        return tree_map(lambda t: t.to(self.type) if isinstance(t, torch.Tensor) else t, value)

    def autocast(self, dtype: torch.dtype, enabled: bool = True) -> contextlib.AbstractContextManager:
        """This device's autocast in ``dtype`` (fp32: none); on the simulated device, with CUDA's policy."""
        if dtype == torch.float32 or not enabled:
            return contextlib.nullcontext()
        # CUDA's policy on the GPU (its own autocast) and on the simulated device (CPU tensors, the simulation);
        # a plain CPU device keeps CPU's.
        target = "cuda" if self.simulated or self.type == "cuda" else "cpu"
        return target_autocast(Policy.load(target, name_of(dtype)), self.type)

    def timer(self) -> Callable[[], float]:
        """A wall clock that waits for the device's queued work before reading the time."""
        import time

        def now() -> float:
            self.sync()
            return time.perf_counter()
        return now


def cuda_device() -> Device | None:
    if not torch.cuda.is_available():
        return None
    return Device(type="cuda", name=torch.cuda.get_device_name(0), sync=torch.cuda.synchronize,
                  reset_peak=torch.cuda.reset_peak_memory_stats, peak_bytes=torch.cuda.max_memory_allocated)


def simulated_cuda() -> Device:
    return Device(type="cpu", name=f"CPU ({platform.processor() or platform.machine()}) simulating CUDA",
                  simulated=True)


def machine(dev: Device | None) -> dict:
    """What the JSON says the run was on: versions, the GPU and its properties."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                            "host": platform.node(), "device": dev.name if dev else "none (no CUDA)"}
    try:
        from importlib.metadata import version

        from ampaudit.precision.fp8 import import_torchao     # quiet about its optional CUDA extensions

        import_torchao()
        info["torchao"] = version("torchao")
    except Exception as exc:          # not installed, or built for another torch
        info["torchao"] = f"unavailable ({type(exc).__name__})"
    if dev is not None and dev.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        # TF32 decides what an "FP32" GEMM or convolution is (the FP32 baselines and calibration's reference).
        info.update(compute_capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32)
    return info
