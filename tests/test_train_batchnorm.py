"""BatchNorm with small per-rank micro-batches: SyncBatchNorm under two gloo ranks (--sync-bn) normalizes over both
ranks' samples, the start-of-training warning names the layers, and check --batch reports AMP304."""
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import ASSETS, load_module, torchrun
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.errors import UsageError
from ampaudit.train.batchnorm import (CpuSyncBatchNorm, SmallBatchWarning, batchnorm_layers, convert_for_ddp,
                                      small_batch_warning)

BN = ASSETS / "train_bn.py"


@pytest.fixture(scope="module")
def bn():
    return load_module(BN)


def test_conversion_keeps_parameters_and_layers_are_named(bn):
    model = bn.build_model()
    weight = model.bn.weight
    assert batchnorm_layers(model) == ["bn"]
    converted = convert_for_ddp(model, "cpu")
    # Not torch's SyncBatchNorm, which DDP refuses in a CPU model
    assert converted is model and type(model.bn) is CpuSyncBatchNorm and not isinstance(model.bn, nn.SyncBatchNorm)
    assert model.bn.weight is weight and batchnorm_layers(model) == []
    x = torch.randn(8, 16)
    with torch.no_grad():           # no process group: plain batch norm, the same numbers as BatchNorm
        assert torch.allclose(model(x), bn.build_model()(x))
    assert type(convert_for_ddp(bn.build_model(), "cuda").bn) is nn.SyncBatchNorm
    with pytest.raises(UsageError, match="divergence checks"):
        convert_for_ddp(bn.build_model(), "cpu", divergence_every=10)


def test_small_batch_warning_text():
    assert small_batch_warning(["bn"], micro_batch=16, accum=1, world_size=1) is None
    assert small_batch_warning([], micro_batch=2, accum=1, world_size=1) is None
    one = small_batch_warning(["layer1.0.bn1", "bn"], micro_batch=4, accum=8, world_size=1)
    assert "layer1.0.bn1, bn normalize over a micro-batch of 4 per rank (accumulation of 8 do not" in one
    assert "below 16" in one and "GroupNorm" in one and "--sync-bn" not in one
    assert "--sync-bn" in small_batch_warning(["bn"], micro_batch=4, accum=1, world_size=2)


def test_trainer_warns_at_start_naming_the_layers(bn):
    with pytest.warns(SmallBatchWarning, match="BatchNorm layers bn normalize over a micro-batch of 4") as seen:
        t = Trainer(bn.build_model(), bn.loss_fn, bn.train_data, accum=4, handle_signals=False)
    assert seen[0].filename == __file__          # the user's Trainer(...) line, not ampaudit's own
    assert len(t.warnings) == 1 and "accumulation of 4" in t.warnings[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallBatchWarning)
        quiet = Trainer(bn.build_model(), bn.loss_fn, bn.paired_data, micro_batch=16, handle_signals=False)
    assert quiet.warnings == []


def test_cli_warning_is_one_line_on_stderr(tmp_path):
    r = CliRunner().invoke(app, ["train", str(BN), "--steps", "1", "--trace", str(tmp_path / "t.jsonl")])
    assert r.exit_code == 0, r.output
    assert r.stderr.count("warning: BatchNorm layers bn normalize over a micro-batch of 4 per rank") == 1
    assert "SmallBatchWarning" not in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_sync_batchnorm_under_two_gloo_ranks_trains_like_one_process_with_both_batches(bn, tmp_path):
    final, trace = tmp_path / "ddp.pt", tmp_path / "ddp.jsonl"
    # A fixed loss scale: a dynamic one overflows at 2**16 on a step where rounding decides, and one skipped step
    # more or less would hide what is compared. The trace makes rank 0's watch replay a pass alone, which a
    # synchronized BatchNorm must run with local statistics (no collective the other rank would never join).
    done = torchrun("-m", "ampaudit", "train", str(BN), "--steps", "6", "--dtype", "float16", "--loss-scale",
                    "1024", "--sync-bn", "--save", str(final), "--trace", str(trace))
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert "trained 6 steps" in done.stdout and "warning: BatchNorm" not in done.stderr   # synced: no warning

    with pytest.warns(SmallBatchWarning, match="micro-batch of 8"):     # 8 is still small, synced or not
        single = Trainer(bn.build_model(), bn.loss_fn, bn.paired_data, optimizer=bn.make_optimizer,
                         dtype="float16", loss_scale=1024.0, handle_signals=False)
    result = single.fit(steps=6)
    losses = [e["loss"] for e in read_trace(trace)[0] if e["event"] == "step"]
    assert losses == pytest.approx(result.losses, rel=1e-3)
    ddp_state = torch.load(final, weights_only=True)
    plain = bn.build_model().state_dict()
    for name, value in single.model.state_dict().items():
        assert torch.allclose(ddp_state[name].float(), value.float(), rtol=1e-3, atol=1e-4), name
        if value.is_floating_point():
            assert not torch.equal(value, plain[name]), name          # it trained
    # Statistics of 8 samples, not of rank 0's 4: the running mean after 6 steps is the single run's.
    assert int(ddp_state["bn.num_batches_tracked"]) == 6


def test_check_batch_reports_batchnorm_with_small_micro_batches(bn):
    model = bn.build_model()
    x = torch.randn(4, 16)
    found = [f for f in ampaudit.check(model, x, device="cuda", batch=4).findings if f.rule == "AMP304"]
    assert [(f.module, f.severity) for f in found] == [("bn", "warning")]
    assert "micro-batch of 4 per rank, below 16" in found[0].message
    assert not [f for f in ampaudit.check(model, x, device="cuda", batch=32).findings if f.rule == "AMP304"]
    assert not [f for f in ampaudit.check(model, x, device="cuda").findings if f.rule == "AMP304"]
    synced = convert_for_ddp(bn.build_model(), "cpu")
    assert not [f for f in ampaudit.check(synced, x, device="cuda", batch=4).findings if f.rule == "AMP304"]
    r = CliRunner().invoke(app, ["check", str(BN), "--batch", "4", "--select", "AMP304", "--format", "json"])
    assert r.exit_code == 1 and '"AMP304"' in r.stdout
    r = CliRunner().invoke(app, ["check", str(BN), "--batch", "0"])
    assert r.exit_code == 2 and "--batch must be >= 1" in r.output
