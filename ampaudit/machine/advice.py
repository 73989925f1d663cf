"""What the facts mean for mixed precision: one check per fact, each with a status and what to change.

    report = doctor()                       # judge(gather()): this machine, as ``ampaudit doctor --format json``
    report = judge(facts)                   # any facts, e.g. a simulated V100 in a test
    [c["id"] for c in report["checks"] if c["status"] == "warn"]      # ["gpu0.bf16"] on a V100
    report["gpus"][0]["supports"]           # {"fp16": True, "bf16": False, "tf32": False, "fp8": False}

A check is ``{"id", "status", "message", "fix", "source"}``: status ``ok`` (nothing to change), ``note`` (worth
knowing, e.g. "fp32" convolutions really run in TF32) or ``warn`` (this setup loses speed or precision);
``fix`` says what to change (None when ok) and ``source`` where the fact is documented, when there is one.
The thresholds (which compute capability has which Tensor Cores, which CPU flags mean native bf16) are
rules/policy/devices.toml; nothing here is a number from a datasheet.
"""
from __future__ import annotations

import re
from typing import Any

from ampaudit.machine.facts import EXTRAS, gather

__all__ = ["doctor", "judge", "VERSION", "STATUSES", "FORMATS"]

VERSION = 1
STATUSES = ("ok", "note", "warn")
FORMATS = ("fp16", "bf16", "tf32", "fp8")
_GET_TORCH = "https://pytorch.org/get-started/locally/"


def doctor() -> dict[str, Any]:
    """This machine and install, judged: ``{"version": 1, "torch", "gpus", "cpu", "flags", "extras", "checks"}``."""
    return judge(gather())


def _table() -> dict:
    from ampaudit.policy import devices

    return devices()


def _policy(device: str):
    from ampaudit.policy import Policy

    return Policy.load(device, "bfloat16")


def _check(id: str, status: str, message: str, fix: str | None = None, source: str | None = None) -> dict:
    assert status in STATUSES and (status == "ok" or fix), (id, status)
    return {"id": id, "status": status, "message": message, "fix": fix if status != "ok" else None,
            "source": source}


def judge(facts: dict[str, Any]) -> dict[str, Any]:
    """The report for ``facts`` (``gather()``'s shape): the facts, each GPU's ``supports`` and the checks."""
    gpus = [{**g, "supports": _supports(g, facts["torch"])} for g in facts["gpus"]]
    cpu = {**facts["cpu"], "native": cpu_native(facts["cpu"])}
    extras = {name: {**e, "enables": EXTRAS[name][1] if name in EXTRAS else None,
                     "installed": all(v is not None for v in e["packages"].values())}
              for name, e in facts["extras"].items()}
    checks = (_torch_checks(facts["torch"], gpus) + _gpu_checks(facts["torch"], gpus)
              + _flag_checks(facts["flags"], gpus) + _cpu_checks(cpu, facts["flags"]) + _extra_checks(extras))
    return {"version": VERSION, "torch": facts["torch"], "gpus": gpus, "cpu": cpu, "flags": facts["flags"],
            "extras": extras, "checks": checks}


# --- torch build -------------------------------------------------------------------------------------------------

def _torch_checks(t: dict, gpus: list[dict]) -> list[dict]:
    head = f"torch {t['version']}, Python {t['python']}, {t['platform']}"
    if t["build"] == "cpu":
        if t.get("nvidia_driver"):
            return [_check("torch", "warn", f"{head}: a CPU-only build on a machine with an NVIDIA driver",
                           f"install a CUDA build of torch to use the GPU ({_GET_TORCH})")]
        return [_check("torch", "ok", f"{head}: CPU-only build (no CUDA, no cuDNN)")]
    out = [_check("torch", "ok", f"{head}: {'ROCm ' + t['hip'] if t['build'] == 'rocm' else 'CUDA ' + t['cuda']} build")]
    cudnn = f"cuDNN {t['cudnn']}" if t.get("cudnn") else "no cuDNN"
    archs = _arch_span(t.get("arch_list") or [])
    if t["build"] == "cuda" and not t.get("cudnn_available"):
        out.append(_check("cuda", "warn", f"built with CUDA {t['cuda']} but {cudnn}: convolutions use slow "
                          "native kernels", f"install a torch build with cuDNN ({_GET_TORCH})"))
    elif t["build"] == "cuda":
        out.append(_check("cuda", "ok", f"built with CUDA {t['cuda']}, {cudnn}" + (f", kernels {archs}" if archs else "")))
    return out


def _arch_span(archs: list[str]) -> str:
    sms = [a for a in archs if a.startswith("sm_")]
    return f"{sms[0]}..{sms[-1]}" if len(sms) > 1 else ", ".join(archs)


# --- GPUs --------------------------------------------------------------------------------------------------------

def _cc(text: str) -> tuple[int, int]:
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def _sm(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def _supports(gpu: dict, t: dict) -> dict[str, bool | None]:
    if t.get("build") == "rocm":   # an AMD GPU: NVIDIA's compute capabilities say nothing about it
        return {f: None for f in FORMATS}
    cc = _cc(gpu["compute_capability"])
    cores = _table()["tensor_cores"]
    return {f: cc >= _cc(str(cores[f]["min_compute_capability"])) for f in FORMATS}


def _has_kernels(cc: tuple[int, int], archs: list[str]) -> bool | None:
    """Whether a build with ``archs`` (torch.cuda.get_arch_list()) runs on ``cc``; None when the list is unknown."""
    if not archs:
        return None
    for arch in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", arch)
        if not m:
            continue
        built = divmod(int(m[2]), 10)
        # A cubin runs on its major version at the same or a later minor ("a"/"f" variants only where built);
        # PTX (compute_XY) is JIT-compiled for any later GPU.
        if m[1] == "sm" and built[0] == cc[0] and (built[1] == cc[1] if m[3] else built[1] <= cc[1]):
            return True
        if m[1] == "compute" and built <= cc:
            return True
    return False


def _groups(gpus: list[dict]) -> list[tuple[str, list[dict]]]:
    """Identical GPUs (name, capability, memory) share their lines: ("gpu0-7", [8 GPUs])."""
    groups: dict[tuple, list[dict]] = {}
    for g in gpus:
        groups.setdefault((g["name"], g["compute_capability"], g["memory_gib"]), []).append(g)
    out = []
    for members in groups.values():
        idx = [g["index"] for g in members]
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        label = f"gpu{idx[0]}" if len(idx) == 1 else f"gpu{idx[0]}-{idx[-1]}" if contiguous else \
            "gpu" + ",".join(map(str, idx))
        out.append((label, members))
    return out


def _gpu_checks(t: dict, gpus: list[dict]) -> list[dict]:
    if not gpus:
        if t["build"] == "cpu":
            return [_check("gpu", "note", "no GPU: check --device cuda still audits for one (CUDA autocast is "
                           "simulated); train runs on the CPU", "to train on a GPU: a machine with one and a CUDA "
                           f"build of torch ({_GET_TORCH})")]
        return [_check("gpu", "warn", f"a {t['build'].upper()} build, but no GPU visible",
                       "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")]
    cores = _table()["tensor_cores"]
    out = []
    for label, members in _groups(gpus):
        g = members[0]
        count = f" x{len(members)}" if len(members) > 1 else ""
        if t["build"] == "rocm":
            out.append(_check(label, "note", f"{g['name']}{count}, {g['memory_gib']} GiB: an AMD GPU, for which "
                              "devices.toml's NVIDIA thresholds do not apply",
                              "see AMD's datasheet for which formats its matrix cores run"))
            continue
        cc, s = _cc(g["compute_capability"]), g["supports"]
        has = [f for f in FORMATS if s[f]]
        out.append(_check(label, "ok", f"{g['name']}{count}, {_sm(cc)}, {g['memory_gib']} GiB: "
                          + (f"Tensor Cores for {', '.join(has)}" if has else "no Tensor Cores")))
        kernels = _has_kernels(cc, t.get("arch_list") or [])
        if kernels is False:
            out.append(_check(f"{label}.kernels", "warn", f"this torch build has no kernels for {_sm(cc)} "
                              f"(it has {_arch_span(t['arch_list'])})", f"install a build for this GPU ({_GET_TORCH})"))
        need = {f: _sm(_cc(str(cores[f]["min_compute_capability"]))) for f in FORMATS}
        if not s["fp16"]:
            out.append(_check(f"{label}.fp16", "warn", f"no Tensor Cores ({_sm(cc)}; fp16 needs {need['fp16']}): "
                              "fp16 autocast saves memory, not time", "train in fp32 here (--dtype float32), or on "
                              "a Volta or newer GPU", cores["fp16"]["source"]))
        elif not s["bf16"]:
            out.append(_check(f"{label}.bf16", "warn", f"bf16 not supported on this GPU ({_sm(cc)}; bf16 Tensor "
                              f"Cores need {need['bf16']})", "train with --dtype float16 and loss scaling "
                              "(ampaudit train's default); audit with ampaudit check --dtype float16",
                              cores["bf16"]["source"]))
        if not s["fp8"]:
            fallback = "bfloat16" if s["bf16"] else "float16"
            out.append(_check(f"{label}.fp8", "note", f"no fp8 Tensor Cores ({_sm(cc)}; fp8 needs {need['fp8']}): "
                              "ampaudit plan --dtype float8 would only emulate",
                              f"train in {fallback} here (--dtype {fallback}); float8 pays off on sm_89+ "
                              "(L4, L40S, H100, H200, B200)", cores["fp8"]["source"]))
    return out


# --- precision flags ---------------------------------------------------------------------------------------------

_MODES = {"ieee": "IEEE fp32", "tf32": "TF32", "bf16": "bf16"}


def _mode(new: Any, legacy: Any) -> str | None:
    """The effective fp32 mode: the new API's value when it decides, else the legacy allow_tf32 flag."""
    if new in ("ieee", "tf32", "bf16"):
        return new
    return None if legacy is None else "tf32" if legacy else "ieee"


def _flag_checks(f: dict, gpus: list[dict]) -> list[dict]:
    src = _table()["flag_sources"]
    cores = _table()["tensor_cores"]
    tf32_gpu = next((g["name"] for g in gpus if g["supports"].get("tf32")), None)
    any_gpu = bool(gpus)
    out = []

    precision = f.get("float32_matmul_precision")
    for what, new, legacy, flag in (
            ("matmuls", f.get("cuda_matmul_fp32_precision"), f.get("cuda_matmul_allow_tf32"),
             "torch.backends.cuda.matmul.fp32_precision"),
            ("convolutions", f.get("cudnn_conv_fp32_precision"), f.get("cudnn_allow_tf32"),
             "torch.backends.cudnn.conv.fp32_precision")):
        cid = "flags.tf32_" + ("matmul" if what == "matmuls" else "conv")
        mode = _mode(new, legacy)
        extra = f" (float32_matmul_precision {precision!r})" if what == "matmuls" and precision else ""
        if mode is None:
            out.append(_check(cid, "note", f"TF32 for fp32 {what}: unknown (legacy and new flags were mixed)",
                              f"set it with the new API only: {flag} = 'ieee' or 'tf32'", src["tf32"]))
        elif not tf32_gpu:
            out.append(_check(cid, "ok", f"fp32 {what} in {_MODES[mode]}{extra}; moot without an sm_80+ GPU"))
        elif mode == "ieee":
            out.append(_check(cid, "ok", f"fp32 {what} run in IEEE fp32 on {tf32_gpu}{extra}"))
        else:
            bits = cores["tf32" if mode == "tf32" else "bf16"]["mantissa_bits"]
            # A 10-bit mantissa has an ulp of 2**-10 relative: ~1e-3, where fp32's 23 bits give ~1e-7.
            rel = f"~{2.0 ** -bits:.0e}".replace("e-0", "e-")
            out.append(_check(cid, "note", f"\"fp32\" {what} run in {_MODES[mode]} on {tf32_gpu}: inputs keep a "
                              f"{bits}-bit mantissa ({rel} relative error){extra}",
                              f"for true fp32 {what}: {flag} = 'ieee' (ampaudit's FP32 references already force it)",
                              src["tf32"]))
    cpu_mode = f.get("mkldnn_matmul_fp32_precision")
    if cpu_mode in ("bf16", "tf32"):
        out.append(_check("flags.cpu_matmul", "note", f"\"fp32\" matmuls on the CPU run in {cpu_mode} (oneDNN)"
                          f"{', float32_matmul_precision ' + repr(precision) if precision else ''}",
                          "torch.set_float32_matmul_precision('highest') for true fp32 on the CPU",
                          src["float32_matmul_precision"]))

    for fmt, key, source in (("fp16", "allow_fp16_reduced_precision_reduction", src["fp16_reduction"]),
                             ("bf16", "allow_bf16_reduced_precision_reduction", src["bf16_reduction"])):
        value = f.get(key)
        cid = f"flags.{fmt}_reduction"
        runs = any(g["supports"].get(fmt) is not False for g in gpus)   # bf16 GEMMs matter where bf16 is native
        if not runs or value is None:
            out.append(_check(cid, "ok", f"{fmt} GEMM reduced-precision reduction "
                              f"{'unknown' if value is None else 'on' if value else 'off'}; moot without "
                              f"{'a GPU' if not any_gpu else 'native ' + fmt}"))
        elif value:
            overflow = ": faster for a large K, can overflow past 65504" if fmt == "fp16" else ""
            out.append(_check(cid, "note", f"{fmt} GEMMs may reduce partial sums in {fmt} (cuBLAS split-K, "
                              f"torch's default){overflow}", f"if {fmt} GEMMs with a large K drift: "
                              f"torch.backends.cuda.matmul.{key} = False", source))
        else:
            out.append(_check(cid, "ok", f"{fmt} GEMMs reduce in fp32 ({key} = False)"))
    if f.get("allow_fp16_accumulation"):
        out.append(_check("flags.fp16_accumulation", "warn" if any_gpu else "note",
                          "fp16 GEMMs accumulate in fp16 (allow_fp16_accumulation): sums over K keep 10 bits "
                          "and overflow past 65504", "torch.backends.cuda.matmul.allow_fp16_accumulation = False",
                          src["fp16_reduction"]))
    if any_gpu and f.get("cudnn_enabled") is False:
        out.append(_check("flags.cudnn", "warn", "cuDNN is disabled (torch.backends.cudnn.enabled = False): "
                          "convolutions use slow native kernels", "torch.backends.cudnn.enabled = True"))
    elif any_gpu and f.get("cudnn_benchmark") is False:
        out.append(_check("flags.cudnn_benchmark", "note", "cudnn.benchmark off: each convolution uses cuDNN's "
                          "heuristic algorithm", "for fixed input shapes: torch.backends.cudnn.benchmark = True "
                          "(times the algorithms once per shape)"))
    elif any_gpu and f.get("cudnn_benchmark"):
        out.append(_check("flags.cudnn_benchmark", "ok", "cudnn.benchmark on (a new input shape is timed again)"))
    return out


# --- CPU ---------------------------------------------------------------------------------------------------------

def cpu_native(cpu: dict) -> dict[str, list[str] | None]:
    """``{"bf16": ["AMX-BF16", ...], "fp16": [...]}``: the named flags this CPU has (None: flags unknown)."""
    flags = cpu.get("flags")
    table = _table()["cpu"]
    return {fmt: None if flags is None else [name for flag, name in table[fmt]["flags"].items() if flag in flags]
            for fmt in ("bf16", "fp16")}


def _cpu_checks(cpu: dict, f: dict) -> list[dict]:
    table = _table()["cpu"]
    native = cpu["native"]
    head = f"{cpu.get('model') or cpu.get('arch')}, torch kernels {cpu.get('capability') or '?'}"
    out = []
    if native["bf16"] is None:
        out.append(_check("cpu", "note", f"{head}; could not read the CPU's flags",
                          "on Linux, /proc/cpuinfo lists them (look for amx_bf16, avx512_bf16)"))
    else:
        fp16 = f"; native fp16: {', '.join(native['fp16'])}" if native["fp16"] else ""
        if native["bf16"]:
            out.append(_check("cpu", "ok", f"{head}; native bf16: {', '.join(native['bf16'])}{fp16}"))
        else:
            out.append(_check("cpu", "warn", f"{head}; no native bf16 ({'/'.join(table['bf16']['flags'].values())}"
                              f"): bf16 matmuls convert to fp32 and back{fp16}", "on this CPU train in fp32 "
                              "(ampaudit train --device cpu --dtype float32); bf16 pays off on AMX CPUs or sm_80+ GPUs",
                              table["bf16"]["source"]))
    # What torch.autocast("cpu") does, from the CPU policy table: which ops it lowers, and which precision-
    # sensitive ops it leaves in bf16 where CUDA's autocast would run them in fp32.
    policy, cuda = _policy("cpu"), _policy("cuda")
    kept = {op for op, category in policy.table.items() if category in ("fp32", "fp32_output")}
    kept_cuda = {op for op, category in cuda.table.items() if category in ("fp32", "fp32_output")}
    stay = [op for op in ("softmax", "layer_norm", "exp", "sum") if op in kept_cuda - kept]
    where = f", on {native['bf16'][0]} here" if native["bf16"] else ", emulated here"
    out.append(_check("cpu.autocast", "note", f"torch.autocast('cpu') runs {sum(c == 'lower' for c in policy.table.values())} ops "
                      f"(matmul, conv, linear) in bf16{where}; {', '.join(stay)} stay bf16 too (CUDA: fp32)",
                      "audit for it: ampaudit check model.py --device cpu --dtype bfloat16", table["bf16"]["source"]))
    return out


# --- extras ------------------------------------------------------------------------------------------------------

def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def _extra_checks(extras: dict) -> list[dict]:
    out = []
    for name, e in extras.items():
        minimum = EXTRAS[name][0] if name in EXTRAS else {}
        have = ", ".join(f"{d} {v}" for d, v in e["packages"].items() if v)
        missing = [d for d, v in e["packages"].items() if v is None]
        old = [f"{d} {v} < {minimum[d]}" for d, v in e["packages"].items()
               if v and d in minimum and _numbers(v) < _numbers(minimum[d])]
        if missing:
            out.append(_check(f"extras.{name}", "note", f"[{name}] not installed ({', '.join(missing)}): "
                              f"needed by {e['enables']}", e["install"]))
        elif old:
            out.append(_check(f"extras.{name}", "warn", f"[{name}] too old ({', '.join(old)}) for {e['enables']}",
                              e["install"].replace("pip install", "pip install -U")))
        else:
            out.append(_check(f"extras.{name}", "ok", f"[{name}] {have}: {e['enables']}"))
    return out
