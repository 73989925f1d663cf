"""The precision preflight: each failure from a model or setting made for it, caught before the first step."""
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ASSETS, ROOT, load_module

from ampaudit.errors import TrainError
from ampaudit.train import Trainer, preflight
from ampaudit.train.fsdp import block_units

BLOCKS = ASSETS / "train_blocks.py"
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")


@pytest.fixture(scope="module")
def blocks():
    return load_module(BLOCKS)


def _fsdp(blocks, model=None, **kwargs):
    return Trainer(model if model is not None else blocks.build_model(), blocks.loss_fn, blocks.train_data,
                   optimizer=blocks.make_optimizer, fsdp=True, handle_signals=False, **{"dtype": "bfloat16", **kwargs})


@pytest.mark.parametrize("entry, check, words", [
    ("mixed_dtype_model", "groups", "'blocks.1' mixes parameter dtypes"),
    ("bf16_model", "masters", "FSDP2 does not upcast"),
])
def test_models_made_to_fail_are_refused_before_sharding(blocks, entry, check, words):
    with pytest.raises(TrainError, match=f"preflight: {check}: .*{words}") as info:
        _fsdp(blocks, getattr(blocks, entry)())
    assert "preflight_only()" in info.value.hint
    assert not dist.is_initialized()          # the group the trainer joined is left again


@pytest.mark.slow
def test_fp16_reduction_under_bf16_is_refused(blocks):
    with pytest.raises(TrainError, match="preflight: reduce: gradients reduced in float16 while training in bf"):
        _fsdp(blocks, reduce_dtype="float16")
    with _fsdp(blocks, dtype="float16", reduce_dtype="float16") as t:   # the scaler backs off: a warning
        assert [c.status for c in t.preflight if c.name == "reduce"] == ["warn"]


def test_memory_past_the_device_is_refused(blocks, monkeypatch):
    monkeypatch.setattr(preflight, "device_memory", lambda device: 64 * 1024)
    with pytest.raises(TrainError, match=r"preflight: memory: .* per rank predicted .* exceeds 90% of the 0\.1 MiB"):
        _fsdp(blocks)


def test_a_wrong_avg_all_reduce_is_caught(blocks, monkeypatch):
    real = dist.all_reduce

    def buggy(tensor, op=dist.ReduceOp.SUM, **kwargs):   # an AVG that forgets to divide, as a broken backend's
        if op == dist.ReduceOp.AVG:
            return real(tensor.mul_(2), op=dist.ReduceOp.SUM, **kwargs)
        return real(tensor, op=op, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", buggy)
    with pytest.raises(TrainError, match="preflight: all-reduce: gloo AVG all-reduce in float32 returned"):
        _fsdp(blocks)


def test_memory_prediction_adds_up(blocks):
    model = blocks.build_model()
    n = sum(p.numel() for p in model.parameters())
    units = [m for _, m in block_units(model)]
    opt = torch.optim.AdamW(model.parameters())
    fsdp = preflight.predict_memory(model, dtype=torch.bfloat16, reduce_dtype=torch.float32, world_size=2, accum=2,
                                    fsdp=True, units=units, optimizer=opt)
    block = sum(p.numel() for p in units[0].parameters())
    assert fsdp == {"parameters": 2 * n, "gradients": 2 * n, "optimizer": 4 * n, "gathered": 2 * block * 2,
                    "accumulated": 4 * n}
    ddp = preflight.predict_memory(model, dtype=torch.float16, reduce_dtype=torch.float32, world_size=2, accum=1,
                                   fsdp=False, units=[], opt_level="O2",
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert ddp == {"parameters": 6 * n, "gradients": 6 * n, "optimizer": 0}


def test_block_units_default_to_the_repeated_children_and_fsdp_wrap_names_classes(blocks):
    model = blocks.build_model()
    assert [n for n, _ in block_units(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in block_units(model, ["Linear"])] == ["embed", "blocks.0.up", "blocks.0.down",
                                                             "blocks.1.up", "blocks.1.down", "blocks.2.up",
                                                             "blocks.2.down", "head"]
    from ampaudit.errors import UsageError
    with pytest.raises(UsageError, match="names Blok, which the model does not contain") as info:
        block_units(model, ["Blok"])
    assert "Block (3)" in info.value.hint


def _preflight_cli(entry: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampaudit", "train", str(BLOCKS), "--entry", entry, "--fsdp",
                           "--dtype", "bfloat16", "--preflight-only", *extra], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_preflight_only_prints_one_line_per_check_and_exits_0_or_1():
    good = _preflight_cli("build_model")
    assert good.returncode == 0, good.stderr
    lines = good.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ok   groups", "ok   masters", "ok   reduce", "ok   memory",
                                                      "ok   all-reduce", "ok   updates", "ok   optimizer state"]
    bad = _preflight_cli("mixed_dtype_model", "--reduce-dtype", "float16")
    assert bad.returncode == 1, bad.stderr
    failing = [line for line in bad.stdout.splitlines() if line.startswith("FAIL")]
    assert [line.split(":")[0] for line in failing] == ["FAIL groups", "FAIL masters", "FAIL reduce"]
    assert all(" -> " in line for line in failing)        # each says what to change
