"""Which low-precision dtype a training run should default to on the device it runs on.

    name, why = default_train_dtype("cpu")   # ("bfloat16", "this CPU multiplies bf16 natively (AVX512-BF16)")

bf16 where the hardware multiplies it natively (CUDA compute capability 8.0 and newer; CPUs with AMX-BF16,
AVX512-BF16 or Arm BF16), float16 where it does not: a GPU before Ampere runs bf16 without Tensor Cores, and a CPU
without native bf16 converts every bf16 GEMM to fp32 and back. On a CPU without native fp16 kernels, fp16 autocast runs
its GEMMs emulated, several times slower than bf16. The thresholds are rules/policy/devices.toml's, the table
``ampaudit doctor`` reads.
"""
from __future__ import annotations


ENV = "AMPAUDIT_DEFAULT_DTYPE"   # a fleet's (or a test suite's) own default, over the device's


def default_train_dtype(device: str) -> tuple[str, str]:
    """``(dtype name, why)`` for training on ``device`` ("cpu" or "cuda") when no ``--dtype`` is given;
    ``AMPAUDIT_DEFAULT_DTYPE`` (float16, bfloat16, float32) overrides the device's answer."""
    import os

    import torch

    from ampaudit.errors import UsageError
    from ampaudit.policy import devices

    pinned = os.environ.get(ENV, "").strip()
    if pinned:
        if pinned not in ("float16", "bfloat16", "float32"):
            raise UsageError(f"{ENV}={pinned!r} is not a training dtype", hint="use float16, bfloat16 or float32")
        return pinned, f"set by {ENV}"

    table = devices()
    if device == "cuda":
        need = float(table["tensor_cores"]["bf16"]["min_compute_capability"])
        major, minor = torch.cuda.get_device_capability()
        cc = major + minor / 10
        if cc >= need:
            return "bfloat16", f"this GPU (sm_{major}{minor}) has bf16 Tensor Cores: no loss scaling needed"
        return "float16", f"this GPU (sm_{major}{minor}) has no bf16 Tensor Cores (sm_80 and newer have)"
    from ampaudit.machine.advice import cpu_native
    from ampaudit.machine.facts import cpu_facts

    native = cpu_native(cpu_facts())           # the names doctor prints, from the same devices.toml table
    bf16, fp16 = native["bf16"] or [], native["fp16"] or []
    if bf16:
        return "bfloat16", f"this CPU multiplies bf16 natively ({', '.join(bf16)})"
    if fp16:
        return "float16", f"this CPU multiplies fp16 natively ({', '.join(fp16)}) but not bf16"
    return "float16", "this CPU has neither native bf16 nor fp16 (--dtype float32 may well be faster)"
