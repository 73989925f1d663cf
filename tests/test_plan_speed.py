"""The roofline speed model of ampaudit plan: fp8 pays off on large GEMMs and loses on small ones."""
from __future__ import annotations

import pytest

from ampaudit.errors import UsageError
from ampaudit.planning import speed
from ampaudit.precision import recipes
from ampaudit.planning.speed import GPUS, RECIPES, cast_bytes, gemm_seconds, linear_times, load_gpus

FP8_GPUS = [name for name, spec in load_gpus().items() if spec["fp8"]]
SHAPES = [(8192, 8192, 8192), (16, 256, 256), (1024, 2048, 1024), (8192, 4096, 14336), (1, 4096, 4096)]
NATIVE = [(gpu, recipe) for recipe in RECIPES for gpu in FP8_GPUS if speed.supports_recipe(gpu, recipe)]
FLOAT8 = [name for name in RECIPES if recipes.recipe(name).family == "float8"]


def test_large_square_gemm_is_compute_bound_with_speedup_just_below_the_peak_ratio():
    h100 = load_gpus()["h100"]
    times = linear_times(8192, 8192, 8192, "h100")
    assert times["bound"] == "compute"
    peak_ratio = h100["fp8_tflops"] / h100["bf16_tflops"]
    assert 0.75 * peak_ratio < times["speedup"] < peak_ratio
    # bf16 is the three GEMMs at peak math: 3 * 2 * 8192**3 flops
    assert times["bfloat16"] == pytest.approx(3 * 2 * 8192**3 / (h100["bf16_tflops"] * 1e12))
    assert times["speedup"] == pytest.approx(times["bfloat16"] / times["float8"])


def test_every_recipe_of_the_shared_table_is_modelled_and_runs_natively_somewhere():
    assert set(RECIPES) == set(recipes.recipe_names())
    assert {recipe for _, recipe in NATIVE} == set(RECIPES)


@pytest.mark.parametrize("gpu,recipe", NATIVE)
def test_tiny_gemm_is_memory_bound_and_slower_in_fp8(gpu, recipe):
    times = linear_times(16, 256, 256, gpu, recipe=recipe)
    assert times["bound"] == "memory"
    assert times["speedup"] < 1.0
    assert times["float8"] > times["bfloat16"]


def test_speedup_grows_with_the_gemm():
    speedups = [linear_times(m, 4096, 4096, "h100")["speedup"] for m in (16, 256, 2048, 16384)]
    assert speedups == sorted(speedups)
    assert speedups[0] < 1.0 < speedups[-1]


def test_rowwise_casts_cost_more_than_tensorwise():
    # rowwise needs a second, column-wise cast (through a bf16 transpose) for every tensor used transposed
    for shape in SHAPES:
        assert cast_bytes(*shape, "rowwise") > cast_bytes(*shape, "tensorwise")
        assert linear_times(*shape, "h100", recipe="rowwise")["speedup"] < linear_times(*shape, "h100")["speedup"]


def test_rowwise_backward_outputs_are_rescaled_by_one_more_pass():
    # torchao runs rowwise backward GEMMs as unit-scale cuBLAS GEMMs and multiplies the bf16 outputs afterwards
    m, k, n = 4096, 4096, 4096
    bandwidth = load_gpus()["h100"]["hbm_tbps"] * 1e12
    gemms = sum(gemm_seconds(*s, "h100", "float8")[0] for s in ((m, k, n), (m, n, k), (n, m, k)))
    times = linear_times(m, k, n, "h100", recipe="float8_rowwise")
    rescale = 2 * 2 * (m * k + n * k) / bandwidth
    assert times["float8"] == pytest.approx(gemms + cast_bytes(m, k, n, "rowwise") / bandwidth + rescale)


def test_short_and_full_recipe_names_give_the_same_times_and_name_the_recipe():
    for short, full in (("tensorwise", "float8_tensorwise"), ("rowwise", "float8_rowwise"),
                        ("rowwise_with_gw_hp", "float8_rowwise_with_gw_hp")):
        a, b = linear_times(4096, 4096, 4096, "h100", recipe=short), linear_times(4096, 4096, 4096, "h100", recipe=full)
        assert a == b and a["recipe"] == full
        assert a["low_precision"] == a["float8"] and {"bfloat16", "float8", "speedup", "bound"} <= set(a)


def test_nvfp4_runs_at_the_fp4_rate_and_reads_block_scales():
    b200 = load_gpus()["b200"]
    m = k = n = 16384
    seconds, bound = gemm_seconds(m, k, n, "b200", "float4", scale_block=16)
    assert bound == "compute" and seconds == pytest.approx(2 * m * k * n / (b200["fp4_tflops"] * 1e12))
    seconds, _ = gemm_seconds(1, 8192, 8192, "b200", "float4", scale_block=16)   # memory-bound: bytes
    reads = 8192 + 8192 * 8192
    assert seconds == pytest.approx((0.5 * reads + reads / 16 + 2 * 8192) / (b200["hbm_tbps"] * 1e12))
    big = {r: linear_times(16384, 8192, 8192, "b200", recipe=r)["speedup"] for r in ("mxfp8", "nvfp4")}
    assert big["nvfp4"] > big["mxfp8"] > 1.0
    with pytest.raises(UsageError, match="float4"):
        gemm_seconds(16, 16, 16, "h100", "float4")


def test_achievable_rates_are_torchaos_fractions_of_peak():
    eff = speed.efficiency()
    assert (eff["gemm"], eff["hbm"], eff["kernel_launch_s"]) == (0.78, 0.92, 2e-6)
    peak, _ = gemm_seconds(8192, 8192, 8192, "h100", "bfloat16")
    real, _ = gemm_seconds(8192, 8192, 8192, "h100", "bfloat16", achievable=True)
    assert real == pytest.approx(peak / 0.78)
    tiny, _ = gemm_seconds(1, 1, 1, "h100", "float8", achievable=True)
    assert tiny == 2e-6   # the per-kernel floor
    assert speed.kernel_seconds([0, 0], "h100", achievable=True) == pytest.approx(4e-6)


def test_rowwise_with_gw_hp_keeps_grad_weight_in_bf16():
    m, k, n = 8192, 8192, 8192
    times = linear_times(m, k, n, "h100", recipe="rowwise_with_gw_hp")
    fp8_gemm, _ = gemm_seconds(m, k, n, "h100", "float8")
    bf16_gemm, _ = gemm_seconds(m, k, n, "h100", "bfloat16")
    casts = cast_bytes(m, k, n, "rowwise_with_gw_hp") / (load_gpus()["h100"]["hbm_tbps"] * 1e12)
    assert times["float8"] == pytest.approx(2 * fp8_gemm + bf16_gemm + casts)


def test_gemm_is_the_max_of_math_and_memory_time():
    spec = load_gpus()["h100"]
    seconds, bound = gemm_seconds(1, 8192, 8192, "h100", "float8")   # one token: reads the whole weight
    assert bound == "memory"
    assert seconds == pytest.approx((8192 + 8192 * 8192 + 2 * 8192) / (spec["hbm_tbps"] * 1e12))
    seconds, bound = gemm_seconds(8192, 8192, 8192, "h100", "bfloat16")
    assert bound == "compute"
    assert seconds == pytest.approx(2 * 8192**3 / (spec["bf16_tflops"] * 1e12))


@pytest.mark.parametrize("shape", SHAPES)
def test_b200_is_faster_than_h100_on_the_same_shapes(shape):
    b200, h100 = linear_times(*shape, "b200"), linear_times(*shape, "h100")
    assert b200["bfloat16"] < h100["bfloat16"]
    assert b200["float8"] < h100["float8"]


def test_h200_differs_from_h100_only_in_bandwidth():
    h100, h200 = load_gpus()["h100"], load_gpus()["h200"]
    assert (h200["bf16_tflops"], h200["fp8_tflops"]) == (h100["bf16_tflops"], h100["fp8_tflops"])
    assert h200["hbm_tbps"] > h100["hbm_tbps"]
    assert linear_times(8192, 8192, 8192, "h200")["speedup"] > linear_times(8192, 8192, 8192, "h100")["speedup"]


def test_every_gpu_has_all_fields_and_a_vendor_source():
    gpus = load_gpus()
    assert {"h100", "h200", "b200"} <= set(gpus)
    assert GPUS == tuple(gpus)
    for name, spec in gpus.items():
        assert spec["form_factor"] == "SXM", name
        assert spec["bf16_tflops"] > 0 and spec["hbm_tbps"] > 0 and spec["nvlink_gbps"] > 0, name
        assert spec["source"].startswith("https://"), name
        if "variant_of" in spec:   # a documented variant: its own source, the datasheet GPU's Tensor Core rates
            base = gpus[spec["variant_of"]]
            assert (spec["bf16_tflops"], spec["fp8_tflops"]) == (base["bf16_tflops"], base["fp8_tflops"]), name
            continue
        assert "nvidia" in spec["source"] or "nvdam.widen.net" in spec["source"], name   # NVIDIA's asset host
        assert spec["datasheet"], name
        if spec["fp8"]:
            assert spec["compute_capability"] >= 8.9, name
            assert spec["fp8_tflops"] == pytest.approx(2 * spec["bf16_tflops"]), name
            # dense is the datasheet's "with sparsity" figure halved
            assert spec["fp8_tflops"] == spec["datasheet_fp8_sparse_tflops"] / 2, name
            assert spec["bf16_tflops"] == spec["datasheet_bf16_sparse_tflops"] / 2, name
        else:
            assert "fp8_tflops" not in spec, name


def test_vendor_numbers():
    gpus = load_gpus()
    assert (gpus["h100"]["bf16_tflops"], gpus["h100"]["fp8_tflops"], gpus["h100"]["hbm_tbps"]) == (989.5, 1979, 3.35)
    assert gpus["h200"]["hbm_tbps"] == 4.8
    assert (gpus["b200"]["bf16_tflops"], gpus["b200"]["fp8_tflops"], gpus["b200"]["hbm_tbps"]) == (2250, 4500, 8.0)
    assert gpus["a100"]["fp8"] is False
    assert (gpus["b200"]["fp4_tflops"], gpus["b200"]["datasheet_fp4_sparse_tflops"]) == (9000, 18000)
    assert [gpus[g]["nvlink_gbps"] for g in ("h100", "h200", "b200", "a100")] == [900, 900, 1800, 600]
    assert gpus["h100_meta"]["hbm_tbps"] == 2.4   # torchtitan's benchmark hardware, torchao's roofline H100


def test_unknown_gpu_is_a_usage_error_naming_the_choices():
    with pytest.raises(UsageError) as info:
        linear_times(16, 256, 256, "h900")
    line = info.value.one_line()
    assert "'h900'" in line and "\n" not in line
    assert all(name in line for name in GPUS)


def test_gpu_without_fp8_and_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="no float8 Tensor Cores"):
        linear_times(16, 256, 256, "a100")
    assert speed.supports_float8("h100") and not speed.supports_float8("a100")
    with pytest.raises(UsageError, match="unknown recipe 'fp6'"):
        linear_times(16, 256, 256, "h100", recipe="fp6")
    with pytest.raises(UsageError, match="M, K, N"):
        linear_times(0, 256, 256, "h100")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_gpu_without_native_kernels_for_a_recipe_is_a_usage_error_naming_it(recipe):
    with pytest.raises(UsageError) as info:
        linear_times(4096, 4096, 4096, "h100", recipe=recipe)
    line = info.value.one_line()
    assert f"no native {recipe} kernels" in line and "needs 10.0" in line and "b200" in line
    assert not speed.supports_recipe("h100", recipe) and speed.supports_recipe("b200", recipe)
    assert linear_times(4096, 4096, 4096, "h100", recipe="blockwise")["speedup"] > 1.0   # Hopper has blockwise


def _torchao_bytes(roofline, m, k, n, **recipe):
    unit = {"peak_mem_bw_bytes_sec": 1.0, "pct_achievable_mem_bw": 1.0}   # so its seconds are bytes
    floor = roofline.KERNEL_LAUNCH_OVERHEAD_SEC   # a kernel moving nothing still counts this

    def theirs(dim0, dim1, role):
        kernels = roofline.get_tensor_memory_traffic_ovhd_s(unit, dim0, dim1, tensor_role=role, **recipe)
        return sum(float(x) for x in kernels if float(x) > floor)

    return theirs(m, k, "input") + theirs(k, n, "weight") + theirs(m, n, "grad_output")


@pytest.mark.parametrize("recipe", FLOAT8 + ["mxfp8"])
def test_cast_traffic_matches_torchaos_own_roofline(recipe):
    # torchao's model of the kernels torch.compile emits for its casts (no fusion with the previous op)
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    m, k, n = 512, 1024, 2048
    names = ({"float8_recipe_name": None, "mx_recipe_name": "mxfp8_cublas"} if recipe == "mxfp8" else
             {"float8_recipe_name": recipes.recipe(recipe).torchao, "mx_recipe_name": None})
    assert cast_bytes(m, k, n, recipe) == _torchao_bytes(roofline, m, k, n, **names)


def test_nvfp4_casts_are_torchaos_fp4_casts_after_an_amax_pass():
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    m, k, n = 512, 1024, 2048
    fp4 = _torchao_bytes(roofline, m, k, n, float8_recipe_name=None, mx_recipe_name="mxfp4_cutlass")
    assert cast_bytes(m, k, n, "nvfp4") == fp4 + 2 * (m * k + k * n + m * n)


def test_blockwise_casts_match_torchaos_blockwise_roofline_without_scales():
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    m, k, n = 8192, 4096, 16384   # every kernel well above torchao's 2 us floor, which it adds per kernel
    huge = 2 ** 40   # one scale per 2**40 elements: torchao's scale bytes vanish, ampaudit leaves them out
    theirs = roofline.get_blockwise_float8_mem_sympy(m, k, n, False, "NVIDIA H100", block_size=huge)
    spec = roofline.get_specs("NVIDIA H100")
    bandwidth = spec["peak_mem_bw_bytes_sec"] * spec["pct_achievable_mem_bw"]
    assert cast_bytes(m, k, n, "blockwise") == pytest.approx(float(theirs) * bandwidth, rel=1e-9)


def test_module_docstring_example_runs_and_says_what_it_returns():
    example = speed.__doc__.split("\n\n")[1]
    namespace = {"linear_times": linear_times, "load_gpus": load_gpus}
    for line in example.splitlines():
        code, _, comment = line.strip().partition("#")
        try:
            value = eval(code, namespace)
        except SyntaxError:   # an assignment
            value = exec(code, namespace)
        if comment.strip().startswith("~"):
            assert round(value, 2) == float(comment.split(":")[0].strip(" ~")), line

