"""The roofline speed model of ampaudit plan: fp8 pays off on large GEMMs and loses on small ones."""
from __future__ import annotations

import pytest

from ampaudit.errors import UsageError
from ampaudit.planning import recipes, speed
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


# --- the whole step against published runs (planning/step_model.py, rules/policy/speed_published.toml) ---------

def _runs():
    from ampaudit.planning.step_model import load_runs
    return load_runs()


def test_published_runs_carry_their_settings_and_sources():
    runs = _runs()
    assert {"torchao_h100", "torchao_b200", "torchtitan_h100"} <= set(runs)
    for run in runs.values():
        assert run.source.startswith("https://") and run.config, run.name
        assert (run.gpus, run.fsdp, run.seq_len, run.compile, run.ac) == (8, 8, 8192, True, "selective_op")
        assert run.model.block_params() * run.model.layers + 2 * run.model.vocab * run.model.dim == \
            pytest.approx(8.03e9, rel=0.01)   # Llama3-8B
    assert runs["torchao_h100"].published == {"bfloat16": 6150.0, "float8_tensorwise": 7689.5,
                                              "float8_rowwise": 6768.0}
    assert runs["torchao_b200"].published["float8_tensorwise"] / runs["torchao_b200"].published["bfloat16"] == \
        pytest.approx(1.254, abs=5e-4)
    assert runs["torchtitan_h100"].local_batch == 2 and runs["torchao_h100"].local_batch == 1


def test_predicted_speedups_stay_within_the_documented_bound_of_the_published_ones():
    from ampaudit.planning.step_model import compare, known_misses, ratio_tolerance
    tol, misses = ratio_tolerance(), known_misses()
    seen = set()
    for run in _runs().values():
        for c in compare(run):
            key = f"{c.run}.{c.recipe}"
            seen.add(key)
            if key in misses:   # documented outside the target: it must stay inside its own bound, and outside
                assert tol < abs(c.error) <= misses[key]["bound"], (key, c.error)
            else:
                assert abs(c.error) <= tol, (key, c.predicted, c.published)
    assert set(misses) <= seen


def test_step_parts_add_up_and_only_the_linears_casts_and_fsdp_change_with_the_recipe():
    from ampaudit.planning.step_model import step_seconds
    run = _runs()["torchao_h100"]
    bf16, fp8 = step_seconds(run, "bfloat16"), step_seconds(run, "tensorwise")
    for step in (bf16, fp8):
        assert step["total"] == pytest.approx(sum(step["parts"].values()))
    assert bf16["parts"]["casts"] == 0 and bf16["parts"]["gemm_low"] == 0 and fp8["parts"]["casts"] > 0
    for part in ("attention", "pointwise", "optimizer"):
        assert bf16["parts"][part] == fp8["parts"][part], part
    assert fp8["parts"]["fsdp_copies"] < bf16["parts"]["fsdp_copies"]   # float8 all-gather moves fewer bytes
    assert fp8["parts"]["gemm_bf16"] == pytest.approx(step_seconds(run, "rowwise")["parts"]["gemm_bf16"])


def test_bf16_gemms_are_six_flops_per_parameter_token_plus_the_recomputed_forwards():
    from ampaudit.planning.step_model import step_seconds
    run = _runs()["torchao_h100"]
    shapes, t = run.model, run.tokens
    linears = shapes.block_linears()
    recomputed = sum(x.k * x.n for x in linears[1::2])   # wk, wo, w3: every second matmul of a block
    flops = 6 * t * (shapes.layers * sum(x.k * x.n for x in linears) + shapes.dim * shapes.vocab)
    flops += 2 * t * shapes.layers * recomputed
    rate = load_gpus()["h100_meta"]["bf16_tflops"] * 1e12 * speed.efficiency()["gemm"]
    assert step_seconds(run, "bfloat16")["parts"]["gemm_bf16"] == pytest.approx(flops / rate, rel=1e-6)


def test_eager_differs_from_compiled_only_in_its_unfused_pointwise_kernels():
    from ampaudit.planning.step_model import step_seconds
    run = _runs()["torchtitan_h100"]
    eager, compiled = step_seconds(run, "bfloat16", compiled=False), step_seconds(run, "bfloat16")
    assert eager["parts"]["pointwise"] > 2 * compiled["parts"]["pointwise"]
    assert {p: v for p, v in eager["parts"].items() if p not in ("pointwise", "communication")} == \
        {p: v for p, v in compiled["parts"].items() if p not in ("pointwise", "communication")}
    with pytest.raises(UsageError, match="eager"):
        step_seconds(run, "tensorwise", compiled=False)


def test_a_step_in_a_recipe_the_gpu_lacks_is_a_usage_error():
    from ampaudit.planning.step_model import step_seconds
    with pytest.raises(UsageError, match="no native mxfp8 kernels"):
        step_seconds(_runs()["torchao_h100"], "mxfp8")
    assert step_seconds(_runs()["torchao_b200"], "nvfp4")["total"] < step_seconds(_runs()["torchao_b200"],
                                                                                  "mxfp8")["total"]


def test_step_model_assumptions_switch_the_terms_they_name():
    import dataclasses
    from ampaudit.planning.step_model import step_seconds
    run = _runs()["torchao_h100"]
    base = step_seconds(run, "rowwise")["parts"]
    no_cse = step_seconds(dataclasses.replace(run, cse=False), "rowwise")["parts"]
    assert no_cse["casts"] > base["casts"] and no_cse["gemm_low"] == base["gemm_low"]
    every = step_seconds(dataclasses.replace(run, recompute_all_low=True), "rowwise")["parts"]
    assert every["gemm_low"] > base["gemm_low"]
    assert step_seconds(dataclasses.replace(run, recompute_all_low=True), "bfloat16")["total"] == \
        step_seconds(run, "bfloat16")["total"]   # bf16 recomputes every second matmul either way


def test_bench_script_prints_every_comparison_and_its_json():
    import importlib.util
    import io
    from contextlib import redirect_stdout
    from pathlib import Path
    import json

    path = Path(__file__).resolve().parents[1] / "bench" / "speed_published.py"
    spec = importlib.util.spec_from_file_location("speed_published", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main([]) == 0
    text = out.getvalue()
    for run, recipe in (("torchao_h100", "float8_tensorwise"), ("torchao_h100", "float8_rowwise"),
                        ("torchao_b200", "mxfp8"), ("torchtitan_h100", "float8_tensorwise")):
        assert any(line.startswith(run) and recipe in line for line in text.splitlines()), (run, recipe)
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main(["--json"])
    rows = json.loads(out.getvalue())
    assert len(rows) == 7 and all(set(r["parts"]) == set(bench.PARTS) for r in rows)
    missed = [r for r in rows if not r["within"]]
    assert all(0 < r["implied_gemm_efficiency"] < speed.efficiency()["gemm"] for r in missed)
    other = {(r["run"], r["recipe"]): r for r in bench.rows({"torchao_h100": "h100"})}
    assert other[("torchao_h100", "float8_rowwise")]["gpu"] == "h100"
    assert other[("torchao_h100", "float8_rowwise")]["predicted_speedup"] != \
        next(r for r in rows if r["run"] == "torchao_h100" and r["recipe"] == "float8_rowwise")["predicted_speedup"]
    with pytest.raises(SystemExit, match="unknown run"):
        bench.rows({"nope": "h100"})
    what_ifs = bench.sensitivity()
    base = {(r["run"], r["recipe"]): r["error"] for r in what_ifs if r["what_if"] == "as modelled"}
    assert base == {(r["run"], r["recipe"]): pytest.approx(r["error"]) for r in rows}
    slower = {(r["run"], r["recipe"]): r["error"] for r in what_ifs if "recomputes every" in r["what_if"]}
    for key, error in slower.items():   # recomputing more fp8 GEMMs can only lower a float8 prediction
        assert error < base[key] if key[1] != "compile_vs_eager" else error == pytest.approx(base[key]), key


def test_selective_checkpointing_sees_torchaos_float8_matmul_as_aten_mm():
    # Grounds the step model's reading of torchtitan's per-op SAC policy (it counts aten.mm calls and saves every
    # other one): a torchao Float8Linear's matmul reaches the policy as aten.mm on its float8 subclass, so the
    # same matmuls are recomputed in float8 as in bf16 (eager SAC, emulated float8 on CPU).
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    float8 = pytest.importorskip("torchao.float8")
    import torch

    seen = []

    def policy(ctx, func, *args, **kwargs):
        if "mm" in str(func) and not ctx.is_recompute:
            seen.append((str(func), [type(a).__name__ for a in args if isinstance(a, torch.Tensor)]))
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False))
    float8.convert_to_float8_training(model.to(torch.bfloat16), config=float8.Float8LinearConfig(emulate=True))
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    checkpoint(model, x, use_reentrant=False, context_fn=context).sum().backward()
    assert seen == [("aten.mm.default", ["Float8TrainingTensor", "Float8TrainingTensor"])] * 2


@pytest.mark.slow
def test_compile_casts_a_shared_input_once_for_every_float8_linear_that_reads_it():
    # Grounds the step model's CSE assumption (wq, wk, wv cast their shared input once): AOTAutograd's joint
    # graph under torch.compile, partitioned as Inductor partitions it, feeds all three float8 matmuls one cast.
    import dataclasses

    import torch
    float8 = pytest.importorskip("torchao.float8")
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32))

        def forward(self, x):
            return self.wq(x).sum() + self.wk(x).sum() + self.wv(x).sum()

    inputs_of_mm = []

    def forward_compiler(graph, _):
        inputs_of_mm.extend(node.args[0].name for node in graph.graph.nodes if "scaled_mm" in str(node.target))
        return make_boxed_func(graph.forward)

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=forward_compiler,
                                     bw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     partition_fn=min_cut_rematerialization_partition)

    model = QKV().to(torch.bfloat16)
    float8.convert_to_float8_training(model)
    for module in model.modules():
        if hasattr(module, "config"):
            module.config = dataclasses.replace(module.config, emulate=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)).backward()
    assert len(inputs_of_mm) == 3 and len(set(inputs_of_mm)) == 1
