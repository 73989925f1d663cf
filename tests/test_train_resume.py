"""Checkpoints and resume: bit-identical continuation (in process, and after SIGKILL), SIGTERM saves and exits."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ASSETS, ROOT, load_module

from ampaudit.errors import TrainError
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.train.checkpoint import LAST, load_checkpoint

MLP = ASSETS / "train_mlp.py"


@pytest.fixture(scope="module")
def mlp():
    return load_module(MLP)


def _trainer(mlp, **kwargs):
    return Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                   scheduler=mlp.make_scheduler, handle_signals=False, **kwargs)


@pytest.mark.parametrize("opt_level, dtype", [("O1", "float16"), ("O2", "float16"), ("O2", "bfloat16")])
def test_resume_is_bit_identical(mlp, tmp_path, opt_level, dtype):
    settings = dict(dtype=dtype, opt_level=opt_level, accum=3, clip_norm=0.5)
    whole = _trainer(mlp, **settings)
    whole.fit(steps=24)   # 72 batches: crosses the 64-batch epoch boundary
    first = _trainer(mlp, checkpoint_dir=tmp_path, checkpoint_every=10, **settings)
    first.fit(steps=13)   # checkpoints at step 10 and at its end, 13 (the SIGKILL test below resumes mid-run)
    assert torch.load(tmp_path / LAST, weights_only=True)["step"] == 13
    second = _trainer(mlp, checkpoint_dir=tmp_path, **settings)
    second.fit(steps=24, resume=True)
    assert second.step == 24
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert whole.scaler.state_dict() == second.scaler.state_dict()
    assert whole.scheduler.state_dict() == second.scheduler.state_dict()
    if whole.masters is not None:
        assert all(torch.equal(a, b) for a, b in zip(whole.masters.masters, second.masters.masters))


def test_checkpoint_holds_everything_and_loads_weights_only(mlp, tmp_path):
    trainer = _trainer(mlp, dtype="float16", opt_level="O2", checkpoint_dir=tmp_path, checkpoint_every=4)
    trainer.fit(steps=4)
    state = torch.load(tmp_path / LAST, weights_only=True)
    assert {"model", "optimizer", "scaler", "masters", "scheduler", "step", "data", "rng", "config"} <= set(state)
    assert state["step"] == 4 and state["data"] == {"epoch": 0, "index": 4}
    assert state["scaler"]["scale"] == 65536.0 and "growth_tracker" in state["scaler"]
    assert state["masters"][0].dtype == torch.float32 and state["model"]["fc1.weight"].dtype == torch.float16
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]   # no temporary files left


def test_resume_refuses_a_different_setup(mlp, tmp_path):
    _trainer(mlp, dtype="float16", checkpoint_dir=tmp_path, checkpoint_every=2).fit(steps=2)
    with pytest.raises(TrainError, match="opt_level O1 -> O2"):
        _trainer(mlp, dtype="float16", opt_level="O2", checkpoint_dir=tmp_path).fit(steps=4, resume=True)
    (tmp_path / LAST).write_bytes(b"not a checkpoint")
    with pytest.raises(TrainError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / LAST)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ampaudit", "train", str(MLP), *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _wait_for(trace, predicate, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trace.exists():
            events, _ = read_trace(trace)
            hit = [e for e in events if predicate(e)]
            if hit:
                return hit[-1]
        if proc.poll() is not None:
            pytest.fail(f"training ended before the event appeared: {proc.communicate()}")
        time.sleep(0.005)
    pytest.fail("timed out waiting for the trace event")


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(mlp, tmp_path, one_thread):
    steps, args = 300, ["--dtype", "float16", "--accum", "2", "--clip-norm", "1.0", "--checkpoint-every", "7"]
    ckpt, trace = tmp_path / "ckpt", tmp_path / "run.jsonl"
    proc = subprocess.Popen(_cli("--steps", str(steps), "--checkpoint", str(ckpt), "--trace", str(trace), *args),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    at = random.randint(14, 60)
    _wait_for(trace, lambda e: e["event"] == "checkpoint" and e["step"] >= at, proc)
    time.sleep(random.uniform(0.0, 0.01))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(e["step"] for e in read_trace(trace)[0] if e["event"] == "step")
    assert killed_at < steps
    final = tmp_path / "final.pt"
    done = subprocess.run(_cli("--steps", str(steps), "--checkpoint", str(ckpt), "--resume", "--save", str(final),
                               *args), env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    whole = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                    scheduler=mlp.make_scheduler, dtype="float16", accum=2, clip_norm=1.0, handle_signals=False)
    whole.fit(steps=steps)
    resumed = torch.load(final, weights_only=True)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed[name], value), f"{name} differs after a kill at step {killed_at}"


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_a_checkpoint_and_exits(tmp_path, signum, code):
    ckpt, trace = tmp_path / "ckpt", tmp_path / "run.jsonl"
    proc = subprocess.Popen(_cli("--steps", "100000", "--checkpoint", str(ckpt), "--trace", str(trace)),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(trace, lambda e: e["event"] == "step" and e["step"] >= 3, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"stopped by {signum.name}" in err and "--resume" in err and "Traceback" not in err
    state = torch.load(ckpt / LAST, weights_only=True)
    last_step = max(e["step"] for e in read_trace(trace)[0] if e["event"] == "step")
    assert state["step"] == last_step
