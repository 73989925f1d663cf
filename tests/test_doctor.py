"""ampaudit doctor: the JSON contract, a screen of text, the advice for simulated GPUs, and this machine for real."""
from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import tomllib

import jsonschema
import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.cli.doctor import render_doctor
from ampaudit.machine import advice, facts as machine_facts
from ampaudit.machine.advice import STATUSES, judge
from ampaudit.machine.facts import EXTRAS

from conftest import ROOT

_NULLABLE_STR = {"type": ["string", "null"]}
_NULLABLE_BOOL = {"type": ["boolean", "null"]}
SCHEMA = {
    "type": "object",
    "required": ["version", "torch", "gpus", "cpu", "flags", "extras", "checks"],
    "additionalProperties": False,
    "properties": {
        "version": {"const": 1},
        "torch": {
            "type": "object",
            "required": ["version", "python", "platform", "build", "cuda", "hip", "cudnn_available", "cudnn",
                         "arch_list", "nvidia_driver"],
            "properties": {
                "version": {"type": "string"}, "python": {"type": "string"}, "platform": {"type": "string"},
                "build": {"enum": ["cpu", "cuda", "rocm"]}, "cuda": _NULLABLE_STR, "hip": _NULLABLE_STR,
                "cudnn_available": {"type": "boolean"}, "cudnn": _NULLABLE_STR,
                "arch_list": {"type": "array", "items": {"type": "string"}}, "nvidia_driver": {"type": "boolean"},
            },
        },
        "gpus": {"type": "array", "items": {
            "type": "object",
            "required": ["index", "name", "compute_capability", "memory_gib", "supports"],
            "properties": {
                "index": {"type": "integer", "minimum": 0}, "name": {"type": "string"},
                "compute_capability": {"type": "string", "pattern": r"^\d+\.\d+$"},
                "memory_gib": {"type": "number"}, "multiprocessors": {"type": "integer"},
                "supports": {"type": "object", "required": ["fp16", "bf16", "tf32", "fp8"],
                             "additionalProperties": _NULLABLE_BOOL},
            },
        }},
        "cpu": {
            "type": "object",
            "required": ["model", "arch", "capability", "flags", "flags_source", "mkldnn", "native"],
            "properties": {
                "model": _NULLABLE_STR, "arch": {"type": "string"}, "capability": _NULLABLE_STR,
                "flags": {"type": ["array", "null"], "items": {"type": "string"}},
                "flags_source": {"enum": ["cpuinfo", "torch", None]}, "mkldnn": {"type": "boolean"},
                "native": {"type": "object", "required": ["bf16", "fp16"],
                           "additionalProperties": {"type": ["array", "null"], "items": {"type": "string"}}},
            },
        },
        "flags": {
            "type": "object",
            "required": ["cuda_matmul_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision",
                         "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
                         "cudnn_benchmark"],
            "additionalProperties": {"type": ["boolean", "string", "null"]},
        },
        "extras": {"type": "object", "additionalProperties": {
            "type": "object",
            "required": ["installed", "packages", "enables", "install"],
            "properties": {
                "installed": {"type": "boolean"},
                "packages": {"type": "object", "additionalProperties": _NULLABLE_STR},
                "enables": {"type": "string"}, "install": {"type": "string", "pattern": r"^pip install 'ampaudit\["},
            },
        }},
        "checks": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "status", "message", "fix"],
            "properties": {
                "id": {"type": "string", "minLength": 1}, "status": {"enum": list(STATUSES)},
                "message": {"type": "string", "minLength": 1}, "fix": _NULLABLE_STR, "source": _NULLABLE_STR,
            },
            # Only a check that is not ok says what to change.
            "if": {"properties": {"status": {"const": "ok"}}},
            "then": {"properties": {"fix": {"type": "null"}}},
            "else": {"properties": {"fix": {"type": "string", "minLength": 1}}},
        }},
    },
}

# --- a simulated machine: torch's default flags, an AMX CPU, every extra installed -------------------------------

DEFAULT_FLAGS = {
    "cuda_matmul_fp32_precision": "none", "cudnn_conv_fp32_precision": "tf32", "mkldnn_matmul_fp32_precision": "none",
    "cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": True, "float32_matmul_precision": "highest",
    "allow_fp16_reduced_precision_reduction": True, "allow_bf16_reduced_precision_reduction": True,
    "allow_fp16_accumulation": False, "cudnn_enabled": True, "cudnn_benchmark": False,
}
V100 = ("Tesla V100-SXM2-16GB", "7.0", 15.8)
A100 = ("NVIDIA A100-SXM4-80GB", "8.0", 79.2)
H100 = ("NVIDIA H100 80GB HBM3", "9.0", 79.1)
GTX1080 = ("NVIDIA GeForce GTX 1080", "6.1", 7.9)
RTX5090 = ("NVIDIA GeForce RTX 5090", "12.0", 31.4)
ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def machine(*gpus, flags=None, cpu_flags=("amx_bf16", "avx512_bf16"), archs=ARCHS, build="cuda", extras=None):
    return {
        "torch": {"version": "2.13.0+cu126", "python": "3.11.7", "platform": "Linux x86_64", "build": build,
                  "cuda": "12.6" if build == "cuda" else None, "hip": None, "cudnn_available": build == "cuda",
                  "cudnn": "9.5.1" if build == "cuda" else None, "arch_list": list(archs) if build == "cuda" else [],
                  "nvidia_driver": bool(gpus)},
        "gpus": [{"index": i, "name": n, "compute_capability": cc, "memory_gib": mem, "multiprocessors": 100}
                 for i, (n, cc, mem) in enumerate(gpus)],
        "cpu": {"model": "Intel(R) Xeon(R) Platinum 8480+", "arch": "x86_64", "capability": "AVX512",
                "flags": None if cpu_flags is None else sorted(cpu_flags), "flags_source": "cpuinfo",
                "mkldnn": True},
        "flags": {**DEFAULT_FLAGS, **(flags or {})},
        "extras": extras or {name: {"packages": {d: "99.0" for d in pkgs}, "install": f"pip install 'ampaudit[{name}]'"}
                             for name, (pkgs, _) in EXTRAS.items()},
    }


def checks(report) -> dict[str, dict]:
    return {c["id"]: c for c in report["checks"]}


def advice_of(c) -> str:
    return f"{c['message']} {c['fix'] or ''}"


def text_of(report) -> str:
    out = io.StringIO()
    render_doctor(report, Console(file=out, width=120))   # what a pipe gets (stdout_console's 120 columns)
    return out.getvalue()


MACHINES = {"cpu": machine(build="cpu"), "v100": machine(V100), "a100": machine(A100), "h100": machine(H100),
            "8xh100": machine(*[H100] * 8), "gtx1080": machine(GTX1080), "rtx5090": machine(RTX5090)}


# --- the contract ------------------------------------------------------------------------------------------------

def test_cli_json_matches_the_schema_and_exits_0():
    r = CliRunner().invoke(app, ["doctor", "--format", "json"])
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.output), SCHEMA)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_simulated_reports_match_the_schema(name):
    jsonschema.validate(json.loads(json.dumps(judge(MACHINES[name]))), SCHEMA)


def test_python_api_is_the_json_of_the_cli(monkeypatch):
    fixed = machine(A100)
    monkeypatch.setattr(advice, "gather", lambda: copy.deepcopy(fixed))
    r = CliRunner().invoke(app, ["doctor", "-f", "json"])
    assert json.loads(r.output) == ampaudit.doctor() == judge(fixed)


def test_bad_format_exits_2():
    r = CliRunner().invoke(app, ["doctor", "--format", "xml"])
    assert r.exit_code == 2 and "table, json" in r.output


def test_warnings_still_exit_0(monkeypatch):
    monkeypatch.setattr(advice, "gather", lambda: machine(V100))
    r = CliRunner().invoke(app, ["doctor"])
    assert r.exit_code == 0 and "warn" in r.output and "gpu0.bf16" in r.output


@pytest.mark.parametrize("name", ["cpu", "v100", "a100", "h100", "8xh100", "gtx1080", "rtx5090"])
def test_text_fits_a_screen(name):
    text = text_of(judge(MACHINES[name]))
    assert len(text.splitlines()) <= 40, text
    assert "[fp8]" in text   # brackets are text, not rich markup


def test_text_of_this_machine_fits_a_screen():
    r = CliRunner().invoke(app, ["doctor"])
    assert r.exit_code == 0, r.output
    assert 5 <= len(r.output.splitlines()) <= 40, r.output


# --- simulated GPUs: the advice ----------------------------------------------------------------------------------

def test_v100_has_fp16_but_no_bf16_or_fp8():
    report = judge(machine(V100))
    assert report["gpus"][0]["supports"] == {"fp16": True, "bf16": False, "tf32": False, "fp8": False}
    c = checks(report)
    assert c["gpu0.bf16"]["status"] == "warn"
    assert "bf16 not supported on this GPU" in c["gpu0.bf16"]["message"]
    assert "--dtype float16 and loss scaling" in c["gpu0.bf16"]["fix"]
    assert c["gpu0.fp8"]["status"] == "note"
    assert "no fp8 Tensor Cores" in c["gpu0.fp8"]["message"]
    assert "ampaudit plan --dtype float8 would only emulate" in c["gpu0.fp8"]["message"]
    assert "--dtype float16" in c["gpu0.fp8"]["fix"]                     # no bf16 to fall back on
    assert "sm_70" in c["gpu0"]["message"] and "Tensor Cores for fp16" in c["gpu0"]["message"]
    # TF32 needs sm_80: the flags change nothing on a V100
    assert c["flags.tf32_conv"]["status"] == "ok" and "moot" in c["flags.tf32_conv"]["message"]
    assert c["flags.bf16_reduction"]["status"] == "ok" and c["flags.fp16_reduction"]["status"] == "note"


def test_a100_has_bf16_and_tf32_but_no_fp8():
    report = judge(machine(A100))
    assert report["gpus"][0]["supports"] == {"fp16": True, "bf16": True, "tf32": True, "fp8": False}
    c = checks(report)
    assert "gpu0.bf16" not in c
    assert c["gpu0.fp8"]["status"] == "note" and "would only emulate" in c["gpu0.fp8"]["message"]
    assert "--dtype bfloat16" in c["gpu0.fp8"]["fix"]
    # torch's defaults on Ampere: matmuls in IEEE fp32, cuDNN convolutions in TF32
    assert c["flags.tf32_matmul"]["status"] == "ok" and "IEEE fp32" in c["flags.tf32_matmul"]["message"]
    conv = c["flags.tf32_conv"]
    assert conv["status"] == "note"
    assert "TF32" in conv["message"] and "10-bit mantissa" in conv["message"] and "~1e-3" in conv["message"]
    assert "torch.backends.cudnn.conv.fp32_precision = 'ieee'" in conv["fix"]
    assert conv["source"].startswith("https://")


def test_h100_supports_everything():
    report = judge(machine(H100))
    assert report["gpus"][0]["supports"] == {"fp16": True, "bf16": True, "tf32": True, "fp8": True}
    c = checks(report)
    assert not [i for i in c if i.startswith("gpu0.")]
    assert c["gpu0"]["message"].endswith("Tensor Cores for fp16, bf16, tf32, fp8")
    assert [x["id"] for x in report["checks"] if x["status"] == "warn"] == []


def test_tf32_matmuls_are_named_for_what_they_do_to_fp32():
    for flags in ({"cuda_matmul_fp32_precision": "tf32"}, {"cuda_matmul_allow_tf32": True},
                  {"cuda_matmul_fp32_precision": "tf32", "float32_matmul_precision": "high"}):
        c = checks(judge(machine(A100, flags=flags)))["flags.tf32_matmul"]
        assert c["status"] == "note", flags
        assert '"fp32" matmuls run in TF32' in c["message"] and "~1e-3 relative error" in c["message"]
        assert "torch.backends.cuda.matmul.fp32_precision = 'ieee'" in c["fix"]


def test_mixed_legacy_and_new_tf32_flags_are_unknown_not_a_crash():
    c = checks(judge(machine(A100, flags={"cuda_matmul_fp32_precision": "none", "cuda_matmul_allow_tf32": None,
                                          "float32_matmul_precision": None})))
    assert c["flags.tf32_matmul"]["status"] == "note" and "unknown" in c["flags.tf32_matmul"]["message"]


def test_reduction_and_accumulation_flags():
    c = checks(judge(machine(A100)))
    assert c["flags.fp16_reduction"]["status"] == "note" and "65504" in c["flags.fp16_reduction"]["message"]
    assert "allow_fp16_reduced_precision_reduction = False" in c["flags.fp16_reduction"]["fix"]
    assert c["flags.bf16_reduction"]["status"] == "note"
    assert "flags.fp16_accumulation" not in c
    c = checks(judge(machine(A100, flags={"allow_fp16_reduced_precision_reduction": False,
                                          "allow_fp16_accumulation": True, "cudnn_benchmark": True})))
    assert c["flags.fp16_reduction"]["status"] == "ok"
    assert c["flags.fp16_accumulation"]["status"] == "warn"
    assert c["flags.cudnn_benchmark"]["status"] == "ok"
    assert checks(judge(machine(A100)))["flags.cudnn_benchmark"]["status"] == "note"


def test_identical_gpus_share_their_lines():
    report = judge(machine(*[H100] * 8))
    c = checks(report)
    assert "gpu0-7" in c and "x8" in c["gpu0-7"]["message"]
    assert len(report["gpus"]) == 8
    mixed = checks(judge(machine(H100, V100, H100)))
    assert {"gpu0,2", "gpu1", "gpu1.bf16"} <= set(mixed)


def test_a_gpu_older_than_volta_has_no_tensor_cores():
    c = checks(judge(machine(GTX1080)))
    assert c["gpu0.fp16"]["status"] == "warn" and "no Tensor Cores" in c["gpu0.fp16"]["message"]
    assert "gpu0.bf16" not in c                 # one warning for the missing Tensor Cores, not one per format


def test_a_build_without_kernels_for_the_gpu():
    c = checks(judge(machine(RTX5090)))
    assert c["gpu0.kernels"]["status"] == "warn" and "sm_120" in c["gpu0.kernels"]["message"]
    assert "gpu0.kernels" not in checks(judge(machine(RTX5090, archs=ARCHS + ["compute_90"])))   # PTX JIT
    assert "gpu0.kernels" not in checks(judge(machine(RTX5090, archs=ARCHS + ["sm_120"])))
    assert "gpu0.kernels" not in checks(judge(machine(A100, archs=["sm_80"])))
    assert "gpu0.kernels" in checks(judge(machine(A100, archs=["sm_90a"])))


def test_cuda_build_without_a_visible_gpu_warns():
    c = checks(judge(machine(build="cuda")))
    assert c["gpu"]["status"] == "warn" and "CUDA_VISIBLE_DEVICES" in c["gpu"]["fix"]


def test_cpu_only_torch_beside_an_nvidia_driver_warns():
    facts = machine(build="cpu")
    facts["torch"]["nvidia_driver"] = True
    assert checks(judge(facts))["torch"]["status"] == "warn"


# --- the CPU ------------------------------------------------------------------------------------------------------

def test_cpu_without_native_bf16_warns_and_says_what_autocast_does():
    c = checks(judge(machine(cpu_flags=())))
    assert c["cpu"]["status"] == "warn" and "no native bf16" in c["cpu"]["message"]
    assert "--dtype float32" in c["cpu"]["fix"]
    assert "emulated" in c["cpu.autocast"]["message"]
    amx = checks(judge(machine(cpu_flags=("amx_bf16", "avx512_fp16"))))
    assert amx["cpu"]["status"] == "ok" and "AMX-BF16" in amx["cpu"]["message"] and "AVX512-FP16" in amx["cpu"]["message"]
    assert "softmax" in amx["cpu.autocast"]["message"] and "--device cpu --dtype bfloat16" in amx["cpu.autocast"]["fix"]
    assert checks(judge(machine(cpu_flags=None)))["cpu"]["status"] == "note"


def test_cpu_fp32_matmuls_in_bf16_are_reported():
    c = checks(judge(machine(flags={"mkldnn_matmul_fp32_precision": "bf16", "float32_matmul_precision": "medium"})))
    assert c["flags.cpu_matmul"]["status"] == "note" and "'highest'" in c["flags.cpu_matmul"]["fix"]


# --- extras -------------------------------------------------------------------------------------------------------

def test_missing_and_old_extras_say_the_pip_command():
    extras = {name: {"packages": {d: "99.0" for d in pkgs}, "install": f"pip install 'ampaudit[{name}]'"}
              for name, (pkgs, _) in EXTRAS.items()}
    extras["fp8"]["packages"]["torchao"] = None
    extras["transformers"]["packages"]["accelerate"] = "0.20.0"
    report = judge(machine(extras=extras))
    c = checks(report)
    assert c["extras.fp8"]["status"] == "note" and c["extras.fp8"]["fix"] == "pip install 'ampaudit[fp8]'"
    assert "ampaudit plan" in c["extras.fp8"]["message"]
    assert report["extras"]["fp8"]["installed"] is False
    assert c["extras.transformers"]["status"] == "warn" and "accelerate 0.20.0 < 0.26" in c["extras.transformers"]["message"]
    assert c["extras.report"]["status"] == "ok"


def test_extras_table_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, (packages, _) in EXTRAS.items():
        assert name in declared, name
        assert sorted(f"{d}>={v}" for d, v in packages.items()) == sorted(declared[name]), name


# --- the data ----------------------------------------------------------------------------------------------------

def test_fp8_threshold_agrees_with_gpus_toml():
    policy = ROOT / "rules" / "policy"
    devices = tomllib.loads((policy / "devices.toml").read_text())
    gpus = tomllib.loads((policy / "gpus.toml").read_text())
    assert devices["tensor_cores"]["fp8"]["min_compute_capability"] == gpus["float8"]["min_compute_capability"]
    for name, spec in gpus["gpu"].items():   # every GPU plan knows is judged the same way here
        has_fp8 = judge(machine((spec["product"], str(spec["compute_capability"]), 80.0)))["gpus"][0]["supports"]["fp8"]
        assert has_fp8 == ("fp8_tflops" in spec), name


def test_every_threshold_and_flag_table_cites_a_source():
    devices = tomllib.loads((ROOT / "rules" / "policy" / "devices.toml").read_text())
    entries = list(devices["tensor_cores"].values()) + list(devices["cpu"].values())
    assert all(e["source"].startswith("https://") and e["says"] for e in entries)
    assert all(url.startswith("https://") for url in devices["flag_sources"].values())
    assert set(devices["tensor_cores"]) == set(advice.FORMATS)


# --- this machine, for real --------------------------------------------------------------------------------------

def test_this_machine():
    report = ampaudit.doctor()
    jsonschema.validate(report, SCHEMA)
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["python"] == ".".join(map(str, sys.version_info[:3]))
    if not torch.cuda.is_available():
        assert report["gpus"] == [] and checks(report)["gpu"]["status"] in ("note", "warn")
    if machine_facts.CPUINFO.is_file():
        assert report["cpu"]["flags_source"] == "cpuinfo"
        text = machine_facts.CPUINFO.read_text()
        for flag in report["cpu"]["flags"]:
            assert f" {flag}" in text
    assert report["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["flags"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert {c["id"] for c in report["checks"]} >= {"torch", "cpu", "cpu.autocast", "flags.tf32_matmul", "extras.fp8"}


@pytest.mark.slow
def test_doctor_is_callable_whatever_was_imported_first():
    # The package is ampaudit.machine, not ampaudit.doctor: importing a module named doctor would bind the module
    # over the function on the ampaudit package.
    code = ("import ampaudit.cli.doctor, ampaudit.machine.facts, ampaudit; r = ampaudit.doctor(); "
            "print(r['version'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"


@pytest.mark.slow
def test_importing_the_doctor_loads_neither_torch_nor_rich():
    code = "import sys, ampaudit.machine; print(sorted(m for m in ('torch', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
