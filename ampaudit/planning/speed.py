"""Roofline estimate of one ``nn.Linear``'s training step (forward + backward) in bfloat16 and in a low-precision
recipe of rules/policy/recipes.toml (float8 tensorwise / rowwise / rowwise_with_gw_hp, mxfp8, nvfp4, blockwise).

    times = linear_times(8192, 8192, 8192, "h100")      # M tokens, K = in_features, N = out_features
    times["speedup"]                                     # ~1.61: bf16 seconds / fp8 seconds (peak ratio is 2)
    times["bound"]                                       # "compute": the fp8 GEMMs are limited by math
    linear_times(16, 256, 256, "h100")["speedup"]        # ~0.51: memory-bound, the casts cost more than fp8 saves
    linear_times(4096, 4096, 14336, "b200", recipe="mxfp8")["recipe"]      # "mxfp8" (short names work too)
    linear_times(8192, 4096, 14336, "h100", achievable=True)["speedup"]    # ~1.61: at torchao's achievable rates
    load_gpus()["h100"]["fp8_tflops"]                    # 1979.0 (dense), from rules/policy/gpus.toml

A step of a Linear is three GEMMs, each of 2*M*N*K flops: output = input @ weight.T (M x K by K x N),
grad_input = grad_output @ weight (M x N by N x K), grad_weight = grad_output.T @ input (N x M by M x K). Each
takes max(flops / rate, bytes moved / HBM bandwidth): bf16 moves 2-byte operands and a 2-byte output; fp8 moves
1-byte operands (fp4 half a byte, plus one scale byte per 32 or 16 elements for MX / NVFP4) and still writes a
bf16 output. The low-precision side also pays the memory-bound passes torchao adds to scale and cast input,
weight and grad_output (``cast_bytes``, counted per recipe below). ``float8`` in the result is that side's time
whatever the recipe (the key callers read); ``low_precision`` is the same number under a recipe-neutral name.

By default the rates are the datasheet peaks. ``achievable=True`` takes the fractions of them torchao's own
roofline uses (rules/policy/gpus.toml [efficiency]: 78% of math, 92% of bandwidth, measured on H100) and its
~2 us floor per kernel: that is what the whole-step model (planning/step_model.py) runs on. Either way it is an
estimate of one Linear, not a measurement, and nothing of the rest of a model (attention, norms, communication,
optimizer): step_model.py adds those and checks the whole against published end-to-end runs (BENCHMARKS.md).
Per layer, torchao's README's H100 examples (up to 0.11) measured 0.80 for M, K, N = 1024, 2048, 1024 and 1.39
for 4096, 8192, 16384, where this model says 0.76 and 1.54 (tensorwise, peak). The speedup approaches the
peak ratio as M, K, N grow; small GEMMs come out memory-bound and slower in low precision, because the cast
passes move more bytes than the GEMMs save. That is the point of the model: it says which layers are not worth
converting.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ampaudit.errors import RuleError, UsageError
from ampaudit.precision import recipes as recipe_table
from ampaudit.datafiles import read_toml, rules_dir

__all__ = ["GPUS", "RECIPES", "Casts", "load_gpus", "efficiency", "min_float8_capability", "supports_float8", "float8_gpus",
           "supports_recipe", "not_native", "require_native", "attention_rates", "gemm_seconds", "cast_kernels", "cast_bytes",
           "rescale_kernels", "kernel_seconds", "linear_times"]

BF16 = 2   # bytes per element
FP8 = 1
FP4 = 0.5
OPERAND_BYTES = {"bfloat16": BF16, "float8": FP8, "float4": FP4}
RATE_KEY = {"bfloat16": "bf16_tflops", "float8": "fp8_tflops", "float4": "fp4_tflops"}

_REQUIRED = ("product", "form_factor", "compute_capability", "bf16_tflops", "hbm_tbps", "nvlink_gbps", "source",
             "datasheet")


@dataclass(frozen=True)
class Casts:
    """Bytes moved per element of input, weight and grad_output by torchao's scale-and-cast kernels in one
    training step (one number per kernel), the dtype of the low-precision GEMMs, whether the grad_weight GEMM
    runs in it too, the elements per scale the GEMM reads (0: one scale per tensor or row, left out), and
    whether the backward GEMMs' outputs are rescaled by a separate kernel."""

    input: tuple[float, ...]
    weight: tuple[float, ...]
    grad_output: tuple[float, ...]
    gemm_dtype: str = "float8"
    low_grad_weight: bool = True
    scale_block: int = 0
    rescale_backward: bool = False


# What torchao really casts. torchao/float8/float8_linear.py calls hp_tensor_to_float8_dynamic six times a step:
# input and weight in forward; in backward grad_output and weight again (for grad_input), then grad_output and
# input again (for grad_weight, along the other dim). tensorwise and rowwise use one config for both uses of a
# tensor; rowwise_with_gw_hp casts weight tensorwise for grad_input and leaves grad_weight in bf16. Eagerly, each
# call is its own amax + cast, and float8_ops.preprocess_addmm copies an fp8 operand to the layout cuBLAS needs.
# torchao is fast only under torch.compile (its +25% is compiled), which fuses these into the kernels counted
# here, as torchao's own roofline model counts them (torchao/testing/training/roofline_utils.py,
# get_tensor_memory_traffic_ovhd_s and get_blockwise_float8_mem_sympy, no fusion with the previous op;
# tests/test_plan_speed.py checks we agree). Scales are left out of the casts as torchao leaves them out.
_CASTS: dict[str, Casts] = {
    # Per tensor: one amax pass (a bf16 read), then one cast that reads bf16 and writes fp8 twice, row-major for
    # the GEMM that reads the tensor as is and column-major for the one that reads it transposed (a tensor-wide
    # scale makes the transposed cast the same numbers). The weight gets a second cast kernel in backward: the
    # autograd function saves the bf16 weight (ctx.save_for_backward(input_hp, weight_hp_t)), not its fp8 cast.
    "float8_tensorwise": Casts(input=(BF16, BF16 + 2 * FP8), weight=(BF16, BF16 + FP8, BF16 + FP8),
                               grad_output=(BF16, BF16 + 2 * FP8)),
    # Per row: a row's amax is taken inside its cast kernel (the row fits on chip), so there is no amax pass.
    # But the transposed use needs scales per column, i.e. a cast along the other dim: one kernel casts along rows
    # and writes a bf16 transposed copy, a second casts that copy (the two cannot fuse without holding the whole
    # tensor on chip). The weight: forward cast, a bf16 transpose in backward, its cast. The backward GEMMs run
    # without fast accumulation, where torchao avoids the rowwise CUTLASS kernel ("so slow without fast-accum"):
    # it calls cuBLAS's tensorwise GEMM with unit scales and multiplies the output by the row and column scales
    # afterwards (torchao/float8/float8_ops.py, addmm_float8_unwrapped, `output *= post_inverse_scale`): one more
    # bf16 read and write of grad_input and grad_weight.
    "float8_rowwise": Casts(input=(BF16 + FP8 + BF16, BF16 + FP8), weight=(BF16 + FP8, 2 * BF16, BF16 + FP8),
                            grad_output=(BF16 + FP8 + BF16, BF16 + FP8), rescale_backward=True),
    # input and grad_output are cast once along rows (grad_weight reads them in bf16); weight rowwise for forward
    # and tensorwise for grad_input, its amax taken from the row scales already computed.
    "float8_rowwise_with_gw_hp": Casts(input=(BF16 + FP8,), weight=(BF16 + FP8, BF16 + FP8),
                                       grad_output=(BF16 + FP8,), low_grad_weight=False),
    # MXFP8 (torchao's mxfp8_cublas): each tensor is cast twice from bf16, along dim0 and along dim1 (1x32 blocks
    # along the reduction dim of each GEMM that reads it); the GEMM reads one e8m0 scale byte per 32 elements.
    "mxfp8": Casts(input=(BF16 + FP8, BF16 + FP8), weight=(BF16 + FP8, BF16 + FP8),
                   grad_output=(BF16 + FP8, BF16 + FP8), scale_block=32),
    # NVFP4: the same two casts (half a byte out, 1x16 blocks with e4m3 scales) after an amax pass for the fp32
    # per-tensor scale (torchao models nvfp4 with dynamic global scale so, roofline_utils inference branch).
    "nvfp4": Casts(input=(BF16, BF16 + FP4, BF16 + FP4), weight=(BF16, BF16 + FP4, BF16 + FP4),
                   grad_output=(BF16, BF16 + FP4, BF16 + FP4), gemm_dtype="float4", scale_block=16),
    # DeepSeek-style blockwise FP8: six quantization kernels, each reads bf16 and writes fp8 for one GEMM layout
    # (torchao's get_blockwise_float8_mem_sympy: input as lhs and rhs, weight twice, grad_output twice). Its GEMMs
    # are counted at the fp8 rate, as torchao's roofline counts them; the per-block rescaling inside a blockwise
    # GEMM makes real kernels slower than that, by an amount no datasheet gives.
    "blockwise": Casts(input=(BF16 + FP8, BF16 + FP8), weight=(BF16 + FP8, BF16 + FP8),
                       grad_output=(BF16 + FP8, BF16 + FP8)),
}
RECIPES = tuple(_CASTS)   # modelled recipes, full names of rules/policy/recipes.toml
GPUS: tuple[str, ...]     # the GPU names of rules/policy/gpus.toml, in file order: see __getattr__


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
    if not {"gemm", "hbm", "kernel_launch_s"} <= set(data.get("efficiency", {})):
        raise RuleError(f"{path.name}: [efficiency] needs gemm, hbm and kernel_launch_s", hint="fix the file")
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


def efficiency() -> dict:
    """rules/policy/gpus.toml [efficiency]: ``gemm`` and ``hbm`` (fractions of peak reached) and
    ``kernel_launch_s`` (the floor of one kernel), with their source."""
    return dict(_gpus_toml()["efficiency"])


def attention_rates() -> dict:
    """rules/policy/gpus.toml [attention]: FlashAttention-2's measured rates on ``reference_gpu``."""
    return dict(_gpus_toml()["attention"])


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


def float8_gpus() -> tuple[str, ...]:
    """The GPUs of rules/policy/gpus.toml with fp8 Tensor Cores, in file order: what ``--speed-model`` takes."""
    return tuple(name for name, spec in load_gpus().items() if spec["fp8"])


def supports_recipe(gpu: str, recipe: str) -> bool:
    """Whether ``gpu`` runs ``recipe`` (full or short name) with native kernels (recipes.toml's compute
    capability); UsageError for an unknown gpu or recipe."""
    return _spec(gpu)["compute_capability"] >= recipe_table.recipe(recipe).min_compute_capability


def not_native(gpu: str, recipe: str) -> str | None:
    """Why ``gpu`` cannot run ``recipe`` with native kernels ("h100 has no native mxfp8 kernels (compute
    capability 9.0 < 10.0)"), None where it can; UsageError for an unknown gpu or recipe."""
    if supports_recipe(gpu, recipe):
        return None
    name = recipe_table.recipe(recipe).name
    have, need = _spec(gpu)["compute_capability"], recipe_table.recipe(name).min_compute_capability
    return f"{gpu} has no native {name} kernels (compute capability {have:.1f} < {need:.1f})"


def _rates(spec: dict, achievable: bool) -> tuple[float, float, float]:
    """(math fraction, bandwidth in bytes/s, per-kernel floor in s) of ``spec`` at peak or achievable rates."""
    if not achievable:
        return 1.0, spec["hbm_tbps"] * 1e12, 0.0
    eff = efficiency()
    return eff["gemm"], eff["hbm"] * spec["hbm_tbps"] * 1e12, eff["kernel_launch_s"]


def gemm_seconds(m: int, k: int, n: int, gpu: str, dtype: str, *, achievable: bool = False,
                 scale_block: int = 0) -> tuple[float, str]:
    """(seconds, "compute" | "memory") of one (M x K) @ (K x N) GEMM on ``gpu`` with ``dtype`` ("bfloat16",
    "float8" or "float4") operands and a bf16 output; ``scale_block``: elements per one-byte block scale read
    with the operands (32 MX, 16 NVFP4, 0 none). At peak rates, or torchao's achievable ones."""
    spec = _spec(gpu)
    key = RATE_KEY.get(dtype)
    if key is None or key not in spec or (dtype != "bfloat16" and not spec["fp8"]):
        raise UsageError(f"no {dtype} GEMM rate for {gpu}", hint="use bfloat16, or a format the GPU has")
    share, bandwidth, floor = _rates(spec, achievable)
    compute = 2.0 * m * k * n / (spec[key] * 1e12 * share)
    reads = m * k + k * n
    scales = reads / scale_block if scale_block else 0.0
    memory = (OPERAND_BYTES[dtype] * reads + scales + BF16 * m * n) / bandwidth
    return max(compute, memory, floor), "compute" if compute >= memory else "memory"


def cast_kernels(recipe: str) -> Casts:
    """The cast kernels of ``recipe`` (full or short name); UsageError for a recipe the model lacks."""
    name = recipe_table.recipe(recipe).name
    if name not in _CASTS:
        raise UsageError(f"no speed model for recipe {name!r}", hint=f"choose one of {', '.join(RECIPES)}")
    return _CASTS[name]


def cast_bytes(m: int, k: int, n: int, recipe: str = "tensorwise") -> float:
    """Bytes torchao's scale-and-cast kernels move in one training step of an M x K -> M x N Linear."""
    casts = cast_kernels(recipe)
    return sum(casts.input) * m * k + sum(casts.weight) * n * k + sum(casts.grad_output) * m * n


def rescale_kernels(m: int, k: int, n: int, casts: Casts) -> list[float]:
    """Bytes of the kernels that rescale the backward GEMMs' bf16 outputs (grad_input M x K, grad_weight N x K)
    where the recipe does so after the GEMM; none otherwise."""
    return [2 * BF16 * m * k, 2 * BF16 * n * k] if casts.rescale_backward else []


def kernel_seconds(byte_counts, gpu: str, *, achievable: bool = False) -> float:
    """Seconds of memory-bound kernels moving ``byte_counts`` (one number per kernel) on ``gpu``."""
    _, bandwidth, floor = _rates(_spec(gpu), achievable)
    return sum(max(count / bandwidth, floor) for count in byte_counts)


def require_native(gpu: str, recipe: str) -> str:
    """The full name of ``recipe`` if ``gpu`` runs it natively; UsageError naming the GPU, the recipe and the
    GPUs that do, otherwise (also for a GPU without fp8 Tensor Cores, or an unknown gpu or recipe)."""
    spec, name = _spec(gpu), recipe_table.recipe(recipe).name
    if not spec["fp8"]:
        raise UsageError(f"{gpu} has no float8 Tensor Cores (compute capability {spec['compute_capability']})",
                         hint=f"estimate for one of {', '.join(g for g, s in load_gpus().items() if s['fp8'])}")
    if not supports_recipe(gpu, name):
        need = recipe_table.recipe(name).min_compute_capability
        able = [g for g in load_gpus() if supports_recipe(g, name)]
        raise UsageError(f"{gpu} has no native {name} kernels (compute capability {spec['compute_capability']}, "
                         f"{name} needs {need})", hint=f"estimate {name} for one of {', '.join(able) or 'none'}")
    return name


def linear_times(m: int, k: int, n: int, gpu: str, *, recipe: str = "tensorwise", achievable: bool = False) -> dict:
    """Forward + backward time of an ``nn.Linear(k, n)`` on ``m`` tokens, on ``gpu``, in bf16 and in ``recipe``
    (full or torchao short name): ``{"bfloat16": s, "float8": s, "low_precision": s, "speedup": bf16 / low,
    "bound": "compute" | "memory", "recipe": full name}``, ``bound`` being that of the low-precision GEMMs that
    take most of their time. UsageError for an unknown gpu or recipe, a GPU without fp8 Tensor Cores or native
    kernels for the recipe (see ``supports_recipe``), or a dimension below 1."""
    casts = cast_kernels(recipe)
    name = require_native(gpu, recipe)
    if min(m, k, n) < 1:
        raise UsageError(f"a Linear needs M, K, N >= 1, got M={m}, K={k}, N={n}", hint="pass the token count too")
    shapes = ((m, k, n), (m, n, k), (n, m, k))   # output, grad_input, grad_weight
    bf16 = sum(gemm_seconds(*shape, gpu, "bfloat16", achievable=achievable)[0] for shape in shapes)
    gemms = [gemm_seconds(*shape, gpu, casts.gemm_dtype, achievable=achievable, scale_block=casts.scale_block)
             for shape in shapes[:2]]
    gemms.append(gemm_seconds(*shapes[2], gpu, casts.gemm_dtype, achievable=achievable,
                              scale_block=casts.scale_block) if casts.low_grad_weight
                 else gemm_seconds(*shapes[2], gpu, "bfloat16", achievable=achievable))
    kernels = [b * m * k for b in casts.input] + [b * n * k for b in casts.weight] + \
              [b * m * n for b in casts.grad_output] + rescale_kernels(m, k, n, casts)
    low = sum(seconds for seconds, _ in gemms) + kernel_seconds(kernels, gpu, achievable=achievable)
    compute_share = sum(seconds for seconds, bound in gemms if bound == "compute")
    bound = "compute" if 2 * compute_share >= sum(seconds for seconds, _ in gemms) else "memory"
    return {"bfloat16": bf16, "float8": low, "low_precision": low, "speedup": bf16 / low, "bound": bound,
            "recipe": name}
