"""FSDP2 under the trainer, on gloo: equivalence across rank counts and with DDP, sharded checkpoints that survive
SIGKILL and load at another world size, the full state_dict of --save."""
import os
import random
import signal
import subprocess
import time

import pytest
import torch
from conftest import ASSETS, load_module, torchrun, torchrun_cmd, worker_env

from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer

BLOCKS = ASSETS / "train_blocks.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


@pytest.fixture(scope="module")
def blocks():
    return load_module(BLOCKS)


def _cmd(nproc: int, *args: str) -> list[str]:
    return torchrun_cmd("-m", "ampaudit", "train", str(BLOCKS), "--entry", "build_model", *args, nproc=nproc)


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun("-m", "ampaudit", "train", str(BLOCKS), "--entry", "build_model", *args, nproc=nproc)


def _close(a: dict, b: dict, rtol=1e-3, atol=1e-4) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=rtol, atol=atol), name


def _fsdp_trainer(blocks, dtype="bfloat16", **kwargs) -> Trainer:
    return Trainer(blocks.build_model(), blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer,
                   dtype=dtype, fsdp=True, clip_norm=1.0, handle_signals=False, **kwargs)


@pytest.mark.slow
def test_two_ranks_accum_2_equal_one_rank_accum_4_and_ddp(blocks, tmp_path, one_thread):
    # float32: DDP and FSDP then compute the same thing (in bf16, DDP's autocast keeps fp32 weights where FSDP
    # gathers them in bf16, and Adam turns those roundings of near-zero gradients into whole lr-sized steps).
    common = ["--steps", "4", "--dtype", "float32", "--clip-norm", "1.0"]
    fsdp2 = _torchrun(2, *common, "--accum", "2", "--fsdp", "--save", str(tmp_path / "fsdp.pt"),
                      "--trace", str(tmp_path / "fsdp.jsonl"))
    assert fsdp2.returncode == 0, fsdp2.stderr[-3000:]
    assert fsdp2.stdout.count("trained 4 steps") == 1          # rank 0 alone prints
    ddp2 = _torchrun(2, *common, "--accum", "2", "--save", str(tmp_path / "ddp.pt"))
    assert ddp2.returncode == 0, ddp2.stderr[-3000:]
    sharded = torch.load(tmp_path / "fsdp.pt", weights_only=True)   # a full state_dict a plain model loads
    blocks.build_model().load_state_dict(sharded)
    with _fsdp_trainer(blocks, "float32", accum=4) as one:   # one rank, in process: a group of one
        result = one.fit(steps=4)
        single = one.full_state_dict()
    _close(sharded, single)
    _close(sharded, torch.load(tmp_path / "ddp.pt", weights_only=True))
    events, problems = read_trace(tmp_path / "fsdp.jsonl")
    assert not problems and events[0]["fsdp"] and events[0]["world_size"] == 2
    checks = next(e for e in events if e["event"] == "preflight")["checks"]
    assert [c["name"] for c in checks] == ["groups", "masters", "updates", "optimizer state", "reduce", "memory",
                                           "all-reduce"]
    assert all(c["status"] == "ok" for c in checks), checks
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert losses == pytest.approx(result.losses, rel=1e-4)     # the mean over ranks
    assert all(e["grad_norm"] is not None for e in events if e["event"] == "step")   # the norm of every shard


@pytest.mark.slow
def test_bf16_two_ranks_equal_one_rank(blocks, tmp_path, one_thread):
    # Activation checkpointing on the two ranks, off on the one: the recompute under FSDP changes nothing.
    done = _torchrun(2, "--steps", "4", "--dtype", "bfloat16", "--accum", "2", "--fsdp", "--clip-per-layer",
                     "--checkpoint-activations", "auto",
                     "--clip-norm", "1.0", "--save", str(tmp_path / "fsdp.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    with Trainer(blocks.build_model(), blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer,
                 dtype="bfloat16", fsdp=True, clip_norm=1.0, clip_mode="layer", accum=4,
                 handle_signals=False) as one:
        one.fit(steps=4)
        _close(torch.load(tmp_path / "fsdp.pt", weights_only=True), one.full_state_dict())


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers may sit in their own process groups)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _wait_for_checkpoint(trace, at: int, proc, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trace.exists() and any(e["event"] == "checkpoint" and e["step"] >= at for e in read_trace(trace)[0]):
            return
        if proc.poll() is not None:
            pytest.fail(f"training ended before step {at}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.005)
    pytest.fail("timed out waiting for a checkpoint")


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical_and_loads_on_one_rank(blocks, tmp_path, one_thread):
    steps, args = 150, ["--accum", "2", "--fsdp", "--dtype", "float16", "--clip-norm", "1.0"]
    ckpt, trace = tmp_path / "ckpt", tmp_path / "run.jsonl"
    proc = subprocess.Popen(_cmd(2, "--steps", str(steps), "--checkpoint", str(ckpt), "--checkpoint-every", "3",
                                 "--trace", str(trace), *args),
                            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_checkpoint(trace, random.randint(6, 30), proc)
    time.sleep(random.uniform(0.0, 0.01))
    for pid in [proc.pid, *_descendants(proc.pid)]:           # torchrun and both workers, mid-run
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    killed_at = max(e["step"] for e in read_trace(trace)[0] if e["event"] == "step")
    assert killed_at < steps
    resumed, whole = tmp_path / "resumed.pt", tmp_path / "whole.pt"
    done = _torchrun(2, "--steps", str(steps), "--checkpoint", str(ckpt), "--checkpoint-every", "3", "--resume",
                     "--save", str(resumed), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
    done = _torchrun(2, "--steps", str(steps), "--save", str(whole), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = torch.load(resumed, weights_only=True), torch.load(whole, weights_only=True)
    for name in b:
        assert torch.equal(a[name], b[name]), f"{name} differs after a kill at step {killed_at}"
    # The 2-rank checkpoint (step 150) reshards into one rank with the same global batch and continues.
    with Trainer(blocks.build_model(), blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer,
                 dtype="float16", accum=4, fsdp=True, clip_norm=1.0, checkpoint_dir=ckpt,
                 handle_signals=False) as one:
        one.fit(steps=steps, resume=True)
        assert one.step == steps
        _close(one.full_state_dict(), b, rtol=0, atol=0)
        result = one.fit(steps=steps + 2, resume=False)
        assert result.steps == steps + 2 and result.loss is not None


@pytest.mark.slow     # two sharded runs and a checkpoint
def test_a_checkpoint_of_another_global_batch_is_refused(blocks, tmp_path):
    ckpt = tmp_path / "ckpt"
    with _fsdp_trainer(blocks, accum=2, checkpoint_dir=ckpt) as first:
        first.fit(steps=2)
    from ampaudit.errors import TrainError

    with _fsdp_trainer(blocks, accum=3, checkpoint_dir=ckpt) as other:
        with pytest.raises(TrainError, match="accum 2 -> 3"):
            other.fit(steps=4, resume=True)


@pytest.mark.slow     # two sharded runs and a checkpoint
def test_a_killed_save_leaves_the_last_good_checkpoint(blocks, tmp_path, monkeypatch):
    from ampaudit.train import sharded_checkpoint

    ckpt = tmp_path / "ckpt"
    with _fsdp_trainer(blocks, checkpoint_dir=ckpt) as t:
        t.fit(steps=2)
        before = {k: v.clone() for k, v in t.full_state_dict().items()}   # it aliases the weights

        def dies(*args, **kwargs):     # the pointer is never moved: as if killed between shards and pointer
            raise KeyboardInterrupt
        monkeypatch.setattr(sharded_checkpoint, "atomic_write_text", dies)
        with pytest.raises(KeyboardInterrupt):
            t.fit(steps=3)
    monkeypatch.undo()
    with _fsdp_trainer(blocks, checkpoint_dir=ckpt) as again:
        again.fit(steps=2, resume=True)
        assert again.step == 2
        _close(again.full_state_dict(), before, rtol=0, atol=0)


ATTRIBUTION_SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {assets!r})
import train_blocks
from ampaudit.train import fsdp
dist.init_process_group("gloo")
rank = dist.get_rank()
model = train_blocks.build_model()
fsdp.shard(model, fsdp.block_units(model), dtype=torch.float16)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
up = model.blocks[2].up.weight                      # 64 rows: rank 0 holds 0-31, rank 1 rows 32-63
if rank == 1:
    up.grad.to_local()[3, 5] = float("inf")
found = fsdp.nonfinite_grads(list(model.named_parameters()))
norm = fsdp.group_norms([[p.grad for p in model.parameters()]], 2.0)[0]
with open({out!r} + str(rank), "w") as fh:     # one file per rank: their stdout lines would interleave
    print("rank", rank, found["params"], found["modules"], float(norm), up.to_local().shape[0], file=fh)
dist.barrier()          # gloo aborts a rank whose peer leaves the group first
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_nonfinite_gradient_in_one_ranks_shard_is_named_on_every_rank(tmp_path):
    script = tmp_path / "attribution.py"
    script.write_text(ATTRIBUTION_SCRIPT.format(assets=str(ASSETS), out=str(tmp_path / "rank")))
    done = torchrun(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}").read_text().strip() for r in (0, 1)]
    assert lines == ["rank 0 ['blocks.2.up.weight'] ['blocks.2.up'] inf 32",
                     "rank 1 ['blocks.2.up.weight'] ['blocks.2.up'] inf 32"]


@pytest.mark.slow
def test_two_rank_fsdp_halt_names_modules_and_writes_a_sharded_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = torchrun("-m", "ampaudit", "train", str(ASSETS / "train_overflow.py"), "--fsdp", "--steps", "50",
                    "--max-consecutive-skips", "3", "--checkpoint", str(ckpt))
    assert "exitcode  : 3" in done.stderr and "SIGABRT" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("error: training halted at step 3") == 1      # rank 0 alone reports
    import json
    diagnosis = json.loads((ckpt / "halt.json").read_text())
    assert {m["module"] for m in diagnosis["overflowing_modules"]} == {"0", "2"}, diagnosis   # modules, not shards
    assert json.loads((ckpt / "halted.json").read_text())["step"] == 3


COMPILE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {assets!r})
import train_blocks as blocks
from ampaudit.train import Trainer
dist.init_process_group("gloo")     # the trainers use it and leave it be (rejoining: test_train_ddp)
runs = {{}}
for compiled in (False, "aot_eager"):     # aot_eager: dynamo and AOTAutograd without inductor's codegen
    with Trainer(blocks.build_model(), blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer,
                 dtype="float16", accum=2, fsdp={fsdp}, compile=compiled, clip_norm=1.0, handle_signals=False,
                 trace={trace!r} if compiled else None, trace_every=2) as t:
        result = t.fit(steps=4)
        runs[compiled] = (result.losses, t.full_state_dict())
(eager_losses, eager), (losses, state) = runs[False], runs["aot_eager"]
ok = all(torch.allclose(eager[k], state[k], rtol=1e-3, atol=1e-4) for k in eager)
with open({out!r} + os.environ["RANK"], "w") as fh:
    print(ok, [round(a / b, 3) for a, b in zip(losses, eager_losses)], file=fh)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp"])
def test_compile_on_two_ranks_trains_as_eager(tmp_path, fsdp):
    script, trace = tmp_path / "compiled.py", tmp_path / "run.jsonl"
    script.write_text(COMPILE_SCRIPT.format(assets=str(ASSETS), trace=str(trace), out=str(tmp_path / "rank"),
                                            fsdp=fsdp))
    done = torchrun(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "rank0").read_text().strip() == "True [1.0, 1.0, 1.0, 1.0]"
    events, problems = read_trace(trace)
    assert not problems and events[0]["compile"] and events[0]["fsdp"] is fsdp
    root = [e for e in events if e["event"] == "stats" and e["module"] == "" and e["phase"] == "forward"]
    assert sum(e["passes"] for e in root) == 3 * 2      # steps 1, 2 and 4 eager, 2 micro-batches each


def test_a_watch_on_a_sharded_model_reads_its_shards_and_never_reruns_alone(blocks):
    from ampaudit.errors import UsageError
    from ampaudit.runtime.session import WatchSession
    from ampaudit.runtime.watch import Watch

    with _fsdp_trainer(blocks) as trainer:          # a group of one: the parameters are DTensors all the same
        model = trainer.model
        with pytest.raises(UsageError, match="sharded"):
            Watch(model, divergence_every=2)
        watch = Watch(model)
        assert watch.max_replays == 0 and not watch.locate_first
        watch.close()
        session = WatchSession(None, memory=True)      # what the Lightning / HF callbacks drive, on rank 0 alone
        session.start(model, dtype=torch.bfloat16, integration="test")
        session.begin_step(1)
        model(torch.randn(4, 16)).sum().backward()
        model.head.weight.grad.to_local()[0, 3] = float("inf")
        session.before_optimizer_step(scaled=True)
        found = session.end_step(skipped=True, scale=1.0)
        session.close()
    assert found == {"params": ["head.weight"], "modules": ["head"]}
    skip = next(e for e in session.events if e["event"] == "skip")
    step = next(e for e in session.events if e["event"] == "step")
    assert skip["scope"] == "rank 0's shards" and step["grad_norm"] is None    # no norm of a shard passed as whole
