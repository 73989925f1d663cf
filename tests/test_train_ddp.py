"""Two-process gloo DDP with accumulation equals one process with the same global batch."""
import pytest
import torch
from conftest import ASSETS, load_module, torchrun

from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer

MLP = ASSETS / "train_mlp.py"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_rank_ddp_equals_one_process_with_the_global_batch(tmp_path):
    final, trace = tmp_path / "ddp.pt", tmp_path / "ddp.jsonl"
    done = torchrun("-m", "ampaudit", "train", str(MLP), "--entry", "deterministic_model", "--steps", "3",
                    "--accum", "2", "--dtype", "float16", "--clip-norm", "1.0", "--save", str(final),
                    "--trace", str(trace))
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert done.stdout.count("trained 3 steps") == 1, done.stdout   # rank 0 alone prints
    events, problems = read_trace(trace)
    assert not problems and events[0]["world_size"] == 2
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]   # rank 0 alone writes

    mlp = load_module(MLP)
    single = Trainer(mlp.deterministic_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
                     dtype="float16", accum=4, clip_norm=1.0, handle_signals=False)
    result = single.fit(steps=3)
    ddp_state = torch.load(final, weights_only=True)
    for name, p in single.model.named_parameters():
        assert torch.allclose(ddp_state[name], p.detach(), rtol=1e-3, atol=1e-4), name
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert losses == pytest.approx(result.losses, rel=1e-3)     # the logged loss is the mean over ranks


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_rank_halt_stops_every_rank_with_exit_3(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = torchrun("-m", "ampaudit", "train", str(ASSETS / "train_overflow.py"), "--steps", "50",
                    "--max-consecutive-skips", "3", "--checkpoint", str(ckpt))
    # torchrun itself exits 1 when a worker fails; the workers' own codes are in its report
    assert done.returncode != 0
    assert "exitcode  : 3" in done.stderr and "SIGABRT" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("error: training halted at step 3") == 1      # rank 0 alone reports
    assert torch.load(ckpt / "halted.pt", weights_only=True)["step"] == 3
    assert (ckpt / "halt.json").is_file()


API_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {assets!r})
import train_mlp as mlp
from ampaudit.train import Trainer
with Trainer(mlp.deterministic_model(), mlp.loss_fn, mlp.train_data, optimizer=mlp.make_optimizer,
             dtype="float16", accum=2, handle_signals=False) as t:
    result = t.fit(steps=2)
    world = t.dist.world_size
with open({out!r} + os.environ["RANK"], "w") as fh:   # one file per rank: stdout lines would interleave
    print("rank", dist.get_rank() if dist.is_initialized() else "left", "world", world, "steps", result.steps,
          file=fh)
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_api_users_under_torchrun_need_only_the_with_block(tmp_path):
    # The trainer joins the group, wraps in DDP, and on leaving the block waits for every rank and leaves the
    # group it joined: no barrier or teardown for the script to copy, no hang, no abort.
    script = tmp_path / "train_api.py"
    script.write_text(API_SCRIPT.format(assets=str(ASSETS), out=str(tmp_path / "rank")))
    done = torchrun(str(script))
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().strip() == "rank left world 2 steps 2"


REJOIN_SCRIPT = """
import os, sys, torch.distributed as dist
sys.path.insert(0, {assets!r})
import train_blocks as blocks
from ampaudit.train import Trainer
steps = []
for fsdp in (False, True, False):   # each trainer joins the group torchrun describes and leaves it again
    with Trainer(blocks.build_model(), blocks.loss_fn, blocks.train_data, optimizer=blocks.make_optimizer,
                 dtype="bfloat16", fsdp=fsdp, handle_signals=False) as t:
        steps.append(t.fit(steps=2).steps)
    steps.append(dist.is_initialized())
with open({out!r} + os.environ["RANK"], "w") as fh:
    print(steps, file=fh)
"""


@pytest.mark.slow
def test_trainers_in_sequence_each_join_and_leave_the_group(tmp_path):
    # A second default group under torchrun's store keys would find the first one's stale addresses and hang.
    script = tmp_path / "rejoin.py"
    script.write_text(REJOIN_SCRIPT.format(assets=str(ASSETS), out=str(tmp_path / "rank")))
    done = torchrun(str(script), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().strip() == "[2, False, 2, False, 2, False]"
