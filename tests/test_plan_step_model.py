"""The whole-step speed model (planning/step_model.py) against the published runs of
rules/policy/speed_published.toml, bench/speed_published.py, and the facts its assumptions rest on."""
from __future__ import annotations

import pytest

from ampaudit.errors import UsageError
from ampaudit.planning import speed
from ampaudit.planning.speed import load_gpus


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
