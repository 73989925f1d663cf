"""Roofline estimate of one ``nn.Linear``'s training step (forward + backward) in bfloat16 and in float8.

    times = linear_times(8192, 8192, 8192, "h100")      # M tokens, K = in_features, N = out_features
    times["speedup"]                                     # ~1.61: bf16 seconds / fp8 seconds (peak ratio is 2)
    times["bound"]                                       # "compute": the fp8 GEMMs are limited by math
    linear_times(16, 256, 256, "h100")["speedup"]        # ~0.51: memory-bound, the casts cost more than fp8 saves
    linear_times(4096, 4096, 14336, "b200", recipe="rowwise")
    load_gpus()["h100"]["fp8_tflops"]                    # 1979.0 (dense), from rules/policy/gpus.toml

A step of a Linear is three GEMMs, each of 2*M*N*K flops: output = input @ weight.T (M x K by K x N),
grad_input = grad_output @ weight (M x N by N x K), grad_weight = grad_output.T @ input (N x M by M x K). Each
takes max(flops / peak rate, bytes moved / HBM bandwidth): bf16 moves 2-byte operands and a 2-byte output; fp8
moves 1-byte operands and still writes a bf16 output. fp8 also pays the memory-bound passes torchao adds to scale
and cast input, weight and grad_output (``cast_bytes``, counted per recipe below).

This is an estimate, not a measurement: ideal efficiency (the datasheet's peak math and bandwidth; torchao's own
roofline takes ~78% and ~92% of them, measured on H100), no kernel launch overhead (torchao counts ~2 us a
kernel), and nothing of the rest of the model (attention, norms, communication, optimizer), so it overstates a
whole model's speedup. The sanity anchor is torchao's benchmark: Llama3-8B, tensorwise with float8 all-gather on
8xH100, +25% tokens/s end to end (the table in torchao/float8/README.md up to torchao 0.15, since moved to
https://github.com/pytorch/ao/blob/main/docs/source/workflows/training.md#e2e-training-benchmarks). Per layer,
that README's H100 examples (up to 0.11) measured 0.80 for M, K, N = 1024, 2048, 1024 and 1.39 for 4096, 8192,
16384, where this model says 0.76 and 1.54 (tensorwise). The speedup approaches the peak ratio of 2 as M, K, N
grow; small GEMMs (few tokens, narrow layers) come out memory-bound and slower in fp8, because the cast passes
move more bytes than the GEMMs save. That is the point of the model: it says which layers are not worth
converting.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ampaudit.errors import RuleError, UsageError
from ampaudit.policy import read_toml, rules_dir

__all__ = ["GPUS", "RECIPES", "load_gpus", "min_float8_capability", "supports_float8", "gemm_seconds", "cast_bytes", "linear_times"]

BF16 = 2   # bytes per element
FP8 = 1

_REQUIRED = ("product", "form_factor", "compute_capability", "bf16_tflops", "hbm_tbps", "source", "datasheet")


@dataclass(frozen=True)
class _Casts:
    """Bytes moved per element of input, weight and grad_output by torchao's scale-and-cast kernels in one
    training step (one number per kernel), and whether the grad_weight GEMM runs in fp8."""

    input: tuple[int, ...]
    weight: tuple[int, ...]
    grad_output: tuple[int, ...]
    fp8_grad_weight: bool = True


# What torchao really casts. torchao/float8/float8_linear.py calls hp_tensor_to_float8_dynamic six times a step:
# input and weight in forward; in backward grad_output and weight again (for grad_input), then grad_output and
# input again (for grad_weight, along the other dim). tensorwise and rowwise use one config for both uses of a
# tensor; rowwise_with_gw_hp casts weight tensorwise for grad_input and leaves grad_weight in bf16. Eagerly, each
# call is its own amax + cast, and float8_ops.preprocess_addmm copies an fp8 operand to the layout cuBLAS needs.
# torchao is fast only under torch.compile (its +25% is compiled), which fuses these into the kernels counted
# here, as torchao's own roofline model counts them (torchao/testing/training/roofline_utils.py,
# get_tensor_memory_traffic_ovhd_s, no fusion with the previous op; tests/test_plan_speed.py checks we agree).
# Scales (one fp32 per tensor or per row) are left out: a few bytes against a whole tensor.
_RECIPES: dict[str, _Casts] = {
    # Per tensor: one amax pass (a bf16 read), then one cast that reads bf16 and writes fp8 twice, row-major for
    # the GEMM that reads the tensor as is and column-major for the one that reads it transposed (a tensor-wide
    # scale makes the transposed cast the same numbers). The weight gets a second cast kernel in backward: the
    # autograd function saves the bf16 weight (ctx.save_for_backward(input_hp, weight_hp_t)), not its fp8 cast.
    "tensorwise": _Casts(input=(BF16, BF16 + 2 * FP8), weight=(BF16, BF16 + FP8, BF16 + FP8),
                         grad_output=(BF16, BF16 + 2 * FP8)),
    # Per row: a row's amax is taken inside its cast kernel (the row fits on chip), so there is no amax pass.
    # But the transposed use needs scales per column, i.e. a cast along the other dim: one kernel casts along rows
    # and writes a bf16 transposed copy, a second casts that copy (the two cannot fuse without holding the whole
    # tensor on chip). The weight: forward cast, a bf16 transpose in backward, its cast.
    "rowwise": _Casts(input=(BF16 + FP8 + BF16, BF16 + FP8), weight=(BF16 + FP8, 2 * BF16, BF16 + FP8),
                      grad_output=(BF16 + FP8 + BF16, BF16 + FP8)),
    # input and grad_output are cast once along rows (grad_weight reads them in bf16); weight rowwise for forward
    # and tensorwise for grad_input, its amax taken from the row scales already computed.
    "rowwise_with_gw_hp": _Casts(input=(BF16 + FP8,), weight=(BF16 + FP8, BF16 + FP8), grad_output=(BF16 + FP8,),
                                 fp8_grad_weight=False),
}
RECIPES = tuple(_RECIPES)
GPUS: tuple[str, ...]   # the GPU names of rules/policy/gpus.toml, in file order: see __getattr__


@lru_cache(maxsize=None)
def _gpus_toml() -> dict:
    path = rules_dir() / "policy" / "gpus.toml"
    data = read_toml(path)
    gpus = data.get("gpu")
    if not isinstance(gpus, dict) or not gpus:
        raise RuleError(f"{path.name}: no [gpu.<name>] tables", hint="fix the file")
    min_cc = data.get("float8", {}).get("min_compute_capability")
    if not isinstance(min_cc, (int, float)):
        raise RuleError(f"{path.name}: [float8] min_compute_capability must be a number", hint="fix the file")
    for name, spec in gpus.items():
        missing = [key for key in _REQUIRED if key not in spec]
        if missing:
            raise RuleError(f"{path.name}: [gpu.{name}] lacks {', '.join(missing)}", hint="fix the file")
        if (spec["compute_capability"] >= min_cc) != ("fp8_tflops" in spec):
            raise RuleError(f"{path.name}: [gpu.{name}] has compute capability {spec['compute_capability']} "
                            f"but {'no' if 'fp8_tflops' not in spec else 'an'} fp8_tflops (fp8 needs {min_cc})",
                            hint="fix the file")
    return data


def load_gpus() -> dict[str, dict]:
    """``{name: spec}`` for every GPU in rules/policy/gpus.toml (read once): the fields the file documents, plus
    ``"fp8"``: whether it has fp8 Tensor Cores (compute capability >= [float8] min_compute_capability)."""
    data = _gpus_toml()
    min_cc = data["float8"]["min_compute_capability"]
    return {name: {**spec, "fp8": spec["compute_capability"] >= min_cc} for name, spec in data["gpu"].items()}


def __getattr__(name: str):
    # GPUS is read from the rules file on first use, not at import: a broken gpus.toml then surfaces as a
    # RuleError where the CLI reports it, instead of breaking every command that imports this module.
    if name == "GPUS":
        return tuple(_gpus_toml()["gpu"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _spec(gpu: str) -> dict:
    gpus = load_gpus()
    if gpu not in gpus:
        raise UsageError(f"unknown gpu {gpu!r}", hint=f"choose one of {', '.join(gpus)}")
    return gpus[gpu]


def min_float8_capability() -> float:
    """The compute capability fp8 Tensor Cores start at (rules/policy/gpus.toml [float8])."""
    return float(_gpus_toml()["float8"]["min_compute_capability"])


def supports_float8(gpu: str) -> bool:
    """Whether ``gpu`` (a name in rules/policy/gpus.toml) has fp8 Tensor Cores; UsageError for an unknown name."""
    return _spec(gpu)["fp8"]


def gemm_seconds(m: int, k: int, n: int, gpu: str, dtype: str) -> tuple[float, str]:
    """(seconds, "compute" | "memory") of one (M x K) @ (K x N) GEMM on ``gpu`` with ``dtype`` ("bfloat16" or
    "float8") operands and a bf16 output, at peak rate and bandwidth."""
    spec = _spec(gpu)
    if dtype == "bfloat16":
        tflops, operand = spec["bf16_tflops"], BF16
    elif dtype == "float8" and spec["fp8"]:
        tflops, operand = spec["fp8_tflops"], FP8
    else:
        raise UsageError(f"no {dtype} GEMM rate for {gpu}", hint="use bfloat16, or float8 on a GPU that has it")
    compute = 2.0 * m * k * n / (tflops * 1e12)
    memory = (operand * (m * k + k * n) + BF16 * m * n) / (spec["hbm_tbps"] * 1e12)
    return max(compute, memory), "compute" if compute >= memory else "memory"


def cast_bytes(m: int, k: int, n: int, recipe: str = "tensorwise") -> int:
    """Bytes torchao's float8 scale-and-cast kernels move in one training step of an M x K -> M x N Linear."""
    casts = _recipe(recipe)
    return sum(casts.input) * m * k + sum(casts.weight) * n * k + sum(casts.grad_output) * m * n


def linear_times(m: int, k: int, n: int, gpu: str, *, recipe: str = "tensorwise") -> dict:
    """Forward + backward time of an ``nn.Linear(k, n)`` on ``m`` tokens, on ``gpu``, in bf16 and in float8 with
    torchao's ``recipe``: ``{"bfloat16": s, "float8": s, "speedup": bf16 / fp8, "bound": "compute" | "memory"}``,
    ``bound`` being that of the fp8 GEMMs that take most of the fp8 GEMM time. UsageError for an unknown gpu or
    recipe, a GPU without fp8 Tensor Cores (see ``supports_float8``) or a dimension below 1."""
    spec = _spec(gpu)
    casts = _recipe(recipe)
    if not spec["fp8"]:
        raise UsageError(f"{gpu} has no float8 Tensor Cores (compute capability {spec['compute_capability']})",
                         hint=f"estimate for one of {', '.join(g for g, s in load_gpus().items() if s['fp8'])}")
    if min(m, k, n) < 1:
        raise UsageError(f"a Linear needs M, K, N >= 1, got M={m}, K={k}, N={n}", hint="pass the token count too")
    shapes = ((m, k, n), (m, n, k), (n, m, k))   # output, grad_input, grad_weight
    bf16 = sum(gemm_seconds(*shape, gpu, "bfloat16")[0] for shape in shapes)
    fp8_dtypes = ("float8", "float8", "float8" if casts.fp8_grad_weight else "bfloat16")
    gemms = [gemm_seconds(*shape, gpu, dtype) for shape, dtype in zip(shapes, fp8_dtypes)]
    fp8 = sum(seconds for seconds, _ in gemms) + cast_bytes(m, k, n, recipe) / (spec["hbm_tbps"] * 1e12)
    compute_share = sum(seconds for seconds, bound in gemms if bound == "compute")
    bound = "compute" if 2 * compute_share >= sum(seconds for seconds, _ in gemms) else "memory"
    return {"bfloat16": bf16, "float8": fp8, "speedup": bf16 / fp8, "bound": bound}


def _recipe(recipe: str) -> _Casts:
    if recipe not in _RECIPES:
        raise UsageError(f"unknown float8 recipe {recipe!r}", hint=f"choose one of {', '.join(RECIPES)}")
    return _RECIPES[recipe]
