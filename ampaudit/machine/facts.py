"""The facts ``ampaudit doctor`` judges: this torch build, its GPUs, the CPU, the precision flags, the extras.

    facts = gather()
    facts["torch"]["build"]                  # "cpu", "cuda" or "rocm"
    facts["gpus"]                            # [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                             #   "compute_capability": "9.0", "memory_gib": 79.1, ...}]
    facts["cpu"]["flags"]                    # ["amx_bf16", "avx512_bf16", ...]: the flags rules/policy/devices.toml names
    facts["flags"]["cudnn_conv_fp32_precision"]   # "tf32": cuDNN's fp32 convolutions use TF32 by default

Everything is plain data (str, int, float, bool, None, lists and dicts), so ``judge`` can be fed a simulated
machine (a V100, an H100) in a test that has no GPU, and the JSON output is this dict as it is. Nothing here
judges; reading a fact never fails: what cannot be read is None.
"""
from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import Any, Callable

__all__ = ["gather", "EXTRAS", "CPUINFO"]

CPUINFO = Path("/proc/cpuinfo")
# Present when an NVIDIA kernel driver is loaded: a CPU-only torch on such a machine is a wrong install.
_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")

# extra -> (the distributions it installs with their minimum versions, what it enables). These mirror
# pyproject.toml's [project.optional-dependencies], which a wheel does not ship; tests/test_doctor.py compares them.
EXTRAS: dict[str, tuple[dict[str, str], str]] = {
    "fp8": ({"torchao": "0.18"}, "ampaudit plan, train --dtype float8 / --plan"),
    "report": ({"plotly": "5.0"}, "ampaudit report --html"),
    "tensorboard": ({"tensorboard": "2.14"}, "ampaudit report --tensorboard, the callbacks' tensorboard="),
    "lightning": ({"lightning": "2.2"}, "the Lightning AmpAuditCallback"),
    "transformers": ({"transformers": "4.44", "accelerate": "0.26"}, "the Hugging Face Trainer AmpAuditCallback"),
}


def gather() -> dict[str, Any]:
    """Read this machine and install: ``{"torch", "gpus", "cpu", "flags", "extras"}`` (see the module doc)."""
    import torch

    return {"torch": _torch(torch), "gpus": _gpus(torch), "cpu": _cpu(torch), "flags": _flags(torch),
            "extras": _extras()}


def _read(get: Callable[[], Any]) -> Any:
    # torch raises RuntimeError reading a legacy TF32 flag once a program set the new fp32_precision API (and
    # AttributeError for a flag an older torch lacks): the fact is then unknown, not an error of doctor's.
    try:
        return get()
    except (RuntimeError, AttributeError):
        return None


def _torch(torch) -> dict[str, Any]:
    build = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    cudnn = _read(torch.backends.cudnn.version) if build != "cpu" else None
    return {
        "version": torch.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "build": build,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn_available": bool(_read(torch.backends.cudnn.is_available)),
        "cudnn": _cudnn_version(cudnn) if cudnn else None,
        # The GPU architectures this build has kernels for ("sm_90", or "compute_90" for PTX); [] without a GPU.
        "arch_list": list(_read(torch.cuda.get_arch_list) or []) if build != "cpu" else [],
        "nvidia_driver": _NVIDIA_DRIVER.is_file(),
    }


def _cudnn_version(v: int) -> str:
    # cuDNN 9 encodes major*10000 + minor*100 + patch; cuDNN 8 and older major*1000 + minor*100 + patch.
    major, rest = divmod(v, 10000) if v >= 90000 else divmod(v, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _gpus(torch) -> list[dict[str, Any]]:
    if not _read(torch.cuda.is_available):
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "compute_capability": f"{p.major}.{p.minor}",
                     "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count})
    return gpus


def cpu_facts() -> dict[str, Any]:
    """The CPU's part of :func:`gather`: model, arch, torch's kernel capability, the named flags it has."""
    import torch

    return _cpu(torch)


def _cpu(torch) -> dict[str, Any]:
    from ampaudit.policy import devices

    table = devices()["cpu"]
    named = {flag for spec in table.values() for flag in spec["flags"]}
    flags, model, source = _cpuinfo()
    if flags is None:
        flags, source = _torch_cpu_flags(torch), "torch"
    mkldnn = torch.backends.mkldnn
    return {
        "model": model or platform.processor() or None,
        "arch": platform.machine(),
        # The vector ISA torch's own CPU kernels were dispatched to (DEFAULT, AVX2, AVX512, SVE256, ...).
        "capability": _read(torch.backends.cpu.get_cpu_capability),
        "flags": sorted(named & flags) if flags is not None else None,
        "flags_source": source if flags is not None else None,
        "mkldnn": bool(_read(mkldnn.is_available)),
    }


def _cpuinfo() -> tuple[set[str] | None, str | None, str | None]:
    """(flags, model name, "cpuinfo") from /proc/cpuinfo: x86's ``flags`` line or arm64's ``Features``."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return None, None, None
    flags: set[str] | None = None
    model = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and flags is None:
            flags = set(value.split())
        elif key == "model name" and model is None:
            model = " ".join(value.split())
    return flags, model, "cpuinfo"


def _torch_cpu_flags(torch) -> set[str] | None:
    # Where there is no /proc/cpuinfo (macOS, Windows), torch's own CPUID probes answer for x86. They are
    # private, so each may be missing: then the flags are unknown rather than absent.
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported",
              "amx_fp16": "_is_amx_fp16_supported"}
    found: set[str] = set()
    for flag, name in probes.items():
        probe = getattr(torch.cpu, name, None)
        if probe is None:
            return None
        if _read(probe):
            found.add(flag)
    return found


def _flags(torch) -> dict[str, Any]:
    b = torch.backends
    return {
        # The new per-backend API (torch >= 2.9): "ieee", "tf32", "bf16" or "none" (defer to the legacy flags).
        "cuda_matmul_fp32_precision": _read(lambda: b.cuda.matmul.fp32_precision),
        "cudnn_conv_fp32_precision": _read(lambda: b.cudnn.conv.fp32_precision),
        "mkldnn_matmul_fp32_precision": _read(lambda: b.mkldnn.matmul.fp32_precision),
        # The legacy flags; None when torch refuses to read them (the new API was used).
        "cuda_matmul_allow_tf32": _read(lambda: b.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": _read(lambda: b.cudnn.allow_tf32),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "allow_fp16_reduced_precision_reduction": _read(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "allow_bf16_reduced_precision_reduction": _read(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "allow_fp16_accumulation": _read(lambda: b.cuda.matmul.allow_fp16_accumulation),
        "cudnn_enabled": _read(lambda: b.cudnn.enabled),
        "cudnn_benchmark": _read(lambda: b.cudnn.benchmark),
    }


def _extras() -> dict[str, Any]:
    # Installed versions from package metadata: importing transformers or lightning to ask would take seconds.
    out = {}
    for extra, (packages, _) in EXTRAS.items():
        out[extra] = {"packages": {dist: _version(dist) for dist in packages},
                      "install": f"pip install 'ampaudit[{extra}]'"}
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
