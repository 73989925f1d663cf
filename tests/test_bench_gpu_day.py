"""bench/gpu_day.py on a CPU: the dry run, the no-CUDA run, the incremental writer, the budget, and each part's
logic with a CPU stand-in for the GPU (the CUDA simulation, or a fake device hook), so a GPU run only swaps in
real CUDA numbers."""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import gpu_day  # noqa: E402
from gpu_day_device import Device, simulated_cuda  # noqa: E402
from gpu_day_record import Budget, PartBudget, Record  # noqa: E402


def _read(out: Path) -> dict:
    return json.loads((out / "gpu_day.json").read_text())


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def counting_device() -> tuple[Device, dict]:
    """A CPU device whose sync / memory hooks count their calls and report a fixed peak."""
    calls = {"sync": 0, "reset": 0}

    def bump(key):
        calls[key] += 1
    dev = Device(type="cpu", name="fake GPU", sync=lambda: bump("sync"), reset_peak=lambda: bump("reset"),
                 peak_bytes=lambda: 3 * 2**20)
    return dev, calls


# -- the entry point ---------------------------------------------------------------------------------------------

def test_dry_run_lists_every_part_its_figures_and_the_budget_split(capsys, monkeypatch):
    monkeypatch.setattr(gpu_day, "cuda_device", lambda: None)
    assert gpu_day.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA" in text
    shares = sum(p.share for p in gpu_day.PARTS.values())
    for name, part in gpu_day.PARTS.items():
        assert f"{name:<12} {480 * part.share / shares:6.0f} s" in text
        assert f"{part.module}.{part.function}" in text and part.figures[:30] in text
    assert gpu_day.main(["--dry-run", "--only", "fp8", "--budget-s", "100"]) == 0
    only = capsys.readouterr().out
    assert f"{'fp8':<12} {100:6.0f} s" in only and "policy" not in only


def test_without_cuda_every_part_is_skipped_and_the_run_exits_0(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_day, "cuda_device", lambda: None)
    assert gpu_day.main(["--out", str(tmp_path), "--install-s", "12"]) == 0
    data = _read(tmp_path)
    assert {n: p["status"] for n, p in data["parts"].items()} == {n: "skipped: no CUDA" for n in gpu_day.PARTS}
    assert data["machine"]["install_s"] == 12 and data["machine"]["torch"] == torch.__version__
    assert "## fp8 (skipped: no CUDA" in (tmp_path / "gpu_day.md").read_text()


def test_budget_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_day.main(["--budget-s", "0", "--dry-run"])
    assert exc.value.code == 2 and "--budget-s must be positive" in capsys.readouterr().err


def test_device_put_moves_traced_constants_too():
    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.mask = torch.ones(2)          # a plain attribute, as fx keeps _tensor_constant0

        def forward(self, x):
            return self.lin(x) * self.mask

    gm = torch.fx.symbolic_trace(WithConstant())
    moved = Device(type="meta", name="meta").put(gm)
    assert moved.lin.weight.is_meta and moved.mask.is_meta
    assert Device(type="meta", name="meta").put({"x": (torch.ones(1), 3)})["x"][0].is_meta


# -- the writer and the budget -----------------------------------------------------------------------------------

def test_record_rewrites_json_and_markdown_after_every_figure(tmp_path):
    rec = Record(tmp_path, machine={"device": "x"})
    rec.start("trainer")
    rec.figure("trainer", "bf16 tokens/s", 300.0, unit="tokens/s", baseline=("fp32 tokens/s", 100.0))
    first = _read(tmp_path)["parts"]["trainer"]
    assert first["status"] == "running" and first["figures"][0]["ratio"] == 3.0
    rec.figure("trainer", "loss", float("inf"), baseline=("none", None))
    rec.table("trainer", "rows", [{"op": "a|b", "cuda": torch.float16}])
    data = _read(tmp_path)["parts"]["trainer"]          # still valid JSON: inf as a string, dtypes named
    assert data["figures"][1]["value"] == "inf" and "ratio" not in data["figures"][1]
    assert data["tables"]["rows"] == [{"op": "a|b", "cuda": "torch.float16"}]
    md = (tmp_path / "gpu_day.md").read_text()
    assert "| bf16 tokens/s | 300 | tokens/s | fp32 tokens/s | 100 | 3.000x |" in md and "a\\|b" in md
    assert not list(tmp_path.glob("*.tmp"))


def test_budget_shares_what_is_left_among_the_parts_still_to_run():
    clock = FakeClock()
    budget = Budget(100, {"a": 1, "b": 1, "c": 2}, clock=clock)
    assert budget.split(["a", "b", "c"]) == {"a": 25, "b": 25, "c": 50}
    with budget.part("a", ["a", "b", "c"]) as a:
        assert a.seconds == 25
        clock.t = 5                       # a finishes early: its 20 s go to b and c
        assert not a.expired()
    with budget.part("b", ["b", "c"]) as b:
        assert b.seconds == pytest.approx(95 / 3)
        clock.t = 5 + 40
        assert b.expired() and b.left() < 0


def _fake_parts(monkeypatch):
    """Two parts in a module of their own: one stops itself at its share, one is stuck in a measurement."""
    def polite(record, part, dev, cfg):
        record.figure("polite", "first", 1.0)
        while not part.expired():
            time.sleep(0.01)
        return "stopped: budget"

    def stuck(record, part, dev, cfg):
        record.figure("stuck", "before the long measurement", 2.0)
        try:
            time.sleep(30)
        except Exception:                 # a part's guard around one measurement does not catch the stop
            return "done"
        return "done"

    monkeypatch.setitem(sys.modules, "gpu_day_fake_parts", types.SimpleNamespace(polite=polite, stuck=stuck))
    monkeypatch.setattr(gpu_day, "PARTS", {name: gpu_day.Part("gpu_day_fake_parts", name, 1.0, "")
                                           for name in ("polite", "stuck")})


def test_budget_stop_keeps_every_figure_recorded(tmp_path, monkeypatch):
    _fake_parts(monkeypatch)
    start = time.monotonic()
    assert gpu_day.main(["--out", str(tmp_path), "--budget-s", "0.4", "--grace-s", "0.2"],
                        device=simulated_cuda()) == 0
    assert time.monotonic() - start < 5
    parts = _read(tmp_path)["parts"]
    assert parts["polite"]["status"] == "stopped: budget" and parts["polite"]["figures"][0]["value"] == 1.0
    assert parts["stuck"]["status"].startswith("stopped: the 0.4 s budget")
    assert parts["stuck"]["figures"][0]["value"] == 2.0


def test_a_part_that_raises_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    def broken(record, part, dev, cfg):
        raise ValueError("no kernel for this")

    monkeypatch.setitem(sys.modules, "gpu_day_fake_parts", types.SimpleNamespace(broken=broken, fine=lambda *a: "done"))
    monkeypatch.setattr(gpu_day, "PARTS", {n: gpu_day.Part("gpu_day_fake_parts", n, 1.0, "")
                                           for n in ("broken", "fine")})
    assert gpu_day.main(["--out", str(tmp_path)], device=simulated_cuda()) == 0
    parts = _read(tmp_path)["parts"]
    assert parts["broken"]["status"] == "error: ValueError: no kernel for this"
    assert "ValueError" in parts["broken"]["traceback"] and parts["fine"]["status"] == "done"


# -- policy truth ------------------------------------------------------------------------------------------------

def test_policy_truth_lists_agree_with_the_simulation_and_catch_plain_cpu_autocast():
    from gpu_day_truth import compare_lists

    budget = PartBudget(60, time.monotonic)
    compared, rows = compare_lists(simulated_cuda(), "bfloat16", budget)
    assert compared > 100 and rows == [], rows[:3]
    # A "GPU" whose autocast is CPU's: CUDA autocast runs acos in fp32, CPU's leaves the list's fp16 input alone.
    compared, rows = compare_lists(Device(type="cpu", name="plain CPU autocast"), "bfloat16", budget)
    acos = [r for r in rows if r["op"] == "acos"]
    assert acos and all(r["cuda"] == "float16" and r["rules/policy"] == r["simulation"] == "float32" for r in acos)


def test_disagree_and_policy_dtype():
    from ampaudit.policy import Policy
    from gpu_day_truth import disagree, policy_dtype

    assert not disagree("bool", "float32", "bool")                  # comparisons follow no autocast table
    assert not disagree("raises: TypeError", "bfloat16", "raises: TypeError")
    assert disagree("float32", "float16", "float16") and disagree("float16", "float16", "float32")
    assert disagree("float16", "raises", "float16")                 # the policy bans it, CUDA ran it
    policy, x = Policy.load("cuda", "bfloat16"), torch.randn(2, 2)
    assert policy_dtype(policy, "softmax", (x,), {}) == "float32"
    assert policy_dtype(policy, "mm", (x, x), {}) == "bfloat16"
    assert policy_dtype(policy, "binary_cross_entropy", (x, x), {}) == "raises"


def test_policy_truth_nodes_of_a_model_file():
    from gpu_day_truth import compare_nodes, model_files

    path = next(p for p in model_files() if p.name == "char_transformer.py")
    compared, rows = compare_nodes(path, "bfloat16", simulated_cuda())
    assert compared > 50 and rows == []
    _, rows = compare_nodes(path, "bfloat16", Device(type="cpu", name="plain CPU autocast"))
    assert rows and all("softmax" in r["node"] and r["cuda"] == "bfloat16" for r in rows)


# -- calibration truth -------------------------------------------------------------------------------------------

def test_calibration_on_the_device_path_finds_what_check_calibrate_finds():
    from gpu_day_truth import findings_of, model_files

    path = next(p for p in model_files() if p.parent.name == "planted" and p.name == "gelu_cube.py")
    simulated = findings_of(path, "bfloat16", None)
    assert simulated and findings_of(path, "bfloat16", simulated_cuda()) == simulated


# -- trainer speed and watch cost --------------------------------------------------------------------------------

@pytest.mark.slow     # alternates two training loops: ~4 s
def test_trainer_speed_alternates_both_loops_and_records_tokens_and_memory(tmp_path):
    from gpu_day_train import trainer_speed

    dev, calls = counting_device()
    rec = Record(tmp_path, machine={})
    cfg = {"shape": "tiny", "rounds": 2, "steps": 1, "configs": ["fp32", "bf16 O2"]}
    assert trainer_speed(rec, PartBudget(60, time.monotonic), dev, cfg) == "done"
    figures = {f["name"]: f for f in _read(tmp_path)["parts"]["trainer"]["figures"]}
    for loop in ("hand-written", "trainer"):
        assert figures[f"{loop} bf16 O2 tokens/s"]["baseline"]["name"] == f"{loop} fp32 tokens/s"
        assert figures[f"{loop} bf16 O2 peak memory"]["value"] == 3.0     # MiB, from the device hook
    assert "trainer / hand-written bf16 O2 step time" in figures
    # Per config and loop: one warm-up call and two rounds, each with its own peak reset; clocks read synced.
    assert calls["reset"] == 2 * 2 * 3 and calls["sync"] >= calls["reset"] * 2


def test_hand_written_o2_trains_fp32_masters_of_a_bf16_model():
    from gpu_day_train import SHAPES, hand_loop, workload

    wl = workload(SHAPES["tiny"])
    built = []
    original = wl.build_model
    wl.build_model = lambda: built.append(original()) or built[-1]
    before = {k: v.clone() for k, v in original().state_dict().items()}
    hand_loop(wl, simulated_cuda(), torch.bfloat16, "O2", steps=2)
    model = built[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(p.float(), before[k].to(torch.bfloat16).float())
               for k, p in model.state_dict().items())


def test_watch_cost_records_each_watch_against_no_hooks(tmp_path):
    from gpu_day_train import watch_cost

    dev, calls = counting_device()
    rec = Record(tmp_path, machine={})
    cfg = {"shape": "tiny", "steps": 4, "warmup": 1, "chunk": 2}
    assert watch_cost(rec, PartBudget(60, time.monotonic), dev, cfg) == "done"
    figures = {f["name"]: f for f in _read(tmp_path)["parts"]["watch"]["figures"]}
    assert set(figures) == {"watch stats step time", "watch divergence step time", "watch both step time"}
    assert all(f["baseline"]["name"] == "no hooks step time" and f["value"] > 0 for f in figures.values())
    assert calls["sync"] == 4 * (1 + 2)          # each loop: its warm-up run and two timed chunks


# -- fp8 against the roofline ------------------------------------------------------------------------------------

def test_gpu_key_and_llama_shapes():
    from gpu_day_fp8 import gpu_key, linear_shapes

    assert gpu_key("NVIDIA H200") == "h200" and gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_key("Tesla V100-SXM2-16GB") is None
    tokens, shapes = linear_shapes("llama3-8b")
    dims = {(k, n) for _, k, n in shapes}
    assert tokens == 8192 and {(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)} <= dims
    tokens, shapes = linear_shapes("sample")
    assert tokens == 1024 and (64, 58) in {(k, n) for _, k, n in shapes}


def test_fp8_speed_compares_each_measurement_with_the_roofline(tmp_path):
    from ampaudit.planning.speed import linear_times
    from gpu_day_fp8 import fp8_speed

    pytest.importorskip("torchao")
    rec = Record(tmp_path, machine={})
    cfg = {"modes": ["eager"], "models": ["sample"], "tokens": 16, "max_shapes": 1, "iters": 1, "gpu": "h200"}
    assert fp8_speed(rec, PartBudget(60, time.monotonic), simulated_cuda(), cfg) == "done"
    figures = _read(tmp_path)["parts"]["fp8"]["figures"]
    assert [f["name"].split()[-3] for f in figures] == ["tensorwise", "rowwise"]
    for f, recipe in zip(figures, ("tensorwise", "rowwise")):
        assert f["baseline"]["value"] == pytest.approx(linear_times(16, 64, 192, "h200", recipe=recipe)["speedup"])
        assert f["value"] > 0


@pytest.mark.slow
def test_simulated_tiny_run_of_every_part(tmp_path):
    assert gpu_day.main(["--simulate", "--tiny", "--out", str(tmp_path)]) == 0
    parts = _read(tmp_path)["parts"]
    assert {n: p["status"] for n, p in parts.items()} == {n: "done" for n in gpu_day.PARTS}
    assert all(p["figures"] for p in parts.values())


def test_gpu_shape_is_the_size_the_docs_give():
    from gpu_day_train import SHAPES, workload

    with torch.device("meta"):
        model = workload(SHAPES["gpu"]).build_model()
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 152      # BENCHMARKS.md, gpu_day.py
    assert SHAPES["gpu"]["batch"] * SHAPES["gpu"]["block"] == 8192


def test_tf32_context_restores_the_flags():
    from gpu_day_train import tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_banned_list_entries_are_compared_and_raise_on_both_sides():
    from gpu_day_truth import list_entries, run_entry

    banned = [e for e in list_entries("cpu") if e[0] == "banned"]
    assert banned and banned[0][1] == "binary_cross_entropy"
    name, op, module, args, kwargs = banned[0]
    got = run_entry(simulated_cuda(), torch.float16, module, op, args, kwargs)
    assert got and all(v.startswith("raises") for v in got.values())


def test_truth_parts_stop_at_their_budget_with_a_partial_figure(tmp_path):
    from gpu_day_truth import calibration_truth, policy_truth

    clock = FakeClock()
    part = PartBudget(1, clock)
    rec = Record(tmp_path, machine={})
    clock.t = 2                                     # spent before the first model
    assert calibration_truth(rec, part, simulated_cuda(), {"dtypes": ["bfloat16"]}) == "stopped: budget"
    fig = _read(tmp_path)["parts"]["calibration"]["figures"][0]
    assert fig["value"] == 0 and fig["baseline"]["value"] == 0 and "stopped by the budget" in fig["note"]
    assert policy_truth(rec, part, simulated_cuda(), {"dtypes": ["bfloat16"]}) == "stopped: budget"
    figures = _read(tmp_path)["parts"]["policy"]["figures"]
    assert figures[0]["baseline"]["value"] == 0 and "stopped by the budget" in figures[1]["note"]


def test_a_model_that_fails_is_a_row_not_the_end_of_the_part(tmp_path, monkeypatch):
    import gpu_day_truth

    def fails(path, dtype, dev):
        raise RuntimeError("device-side assert")

    monkeypatch.setattr(gpu_day_truth, "findings_of", fails)
    rec = Record(tmp_path, machine={})
    cfg = {"dtypes": ["bfloat16"], "models": 2}
    assert gpu_day_truth.calibration_truth(rec, PartBudget(60, time.monotonic), simulated_cuda(), cfg) == "done"
    part = _read(tmp_path)["parts"]["calibration"]
    assert [r["error"] for r in part["tables"]["differing findings"]] == ["RuntimeError: device-side assert"] * 2
    assert part["figures"][0]["value"] == 0 and part["figures"][0]["baseline"]["value"] == 2
