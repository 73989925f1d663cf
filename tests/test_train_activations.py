"""Activation checkpointing of the repeated blocks: which blocks, the same weights as without it on CPU (dropout,
autocast, a loss scaler, O2), fewer saved activations, and the watch recording each block's forward once."""
import pytest
import torch
import torch.nn as nn
from conftest import SAMPLES, load_module
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import UsageError
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.train.activations import CheckpointedForward, checkpoint_blocks, repeated_blocks, uncheckpoint


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.2)          # draws from the RNG: the recompute must draw the same mask
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x, scale=1.0):
        return x + scale * self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 1))   # repeats Linear only

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


def build():
    torch.manual_seed(0)
    return Net()


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        x = torch.randn(16, 8, generator=g)
        yield x, x.sum(1, keepdim=True).sin()


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()


def test_auto_picks_the_repeated_blocks_and_names_pick_classes():
    net = build()
    assert repeated_blocks(net) == ["blocks.0", "blocks.1", "blocks.2"]
    assert checkpoint_blocks(net, "Block,Dropout") == ["blocks.0", "blocks.1", "blocks.2"]   # outermost only
    assert isinstance(net.blocks[1].__dict__["forward"], CheckpointedForward)
    assert uncheckpoint(net) == 3 and "forward" not in net.blocks[1].__dict__
    assert checkpoint_blocks(build(), ["LayerNorm"]) == ["blocks.0.norm", "blocks.1.norm", "blocks.2.norm"]
    with pytest.raises(UsageError, match="no module of class Blok"):
        checkpoint_blocks(build(), "Blok")
    with pytest.raises(UsageError, match="no repeated blocks"):
        checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "auto")
    gpt = load_module(SAMPLES / "char_transformer.py").CharTransformer(20, 16, 2, 2, 8)
    assert repeated_blocks(gpt) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("dtype, opt_level", [("float16", "O1"), ("bfloat16", "O1"), ("float16", "O2")])
def test_checkpointing_ends_with_the_same_weights(dtype, opt_level):
    states = []
    for spec in (None, "auto"):
        torch.manual_seed(7)            # dropout masks come from the global generator
        t = Trainer(build(), loss_fn, data, dtype=dtype, opt_level=opt_level, accum=2, clip_norm=1.0,
                    checkpoint_activations=spec, handle_signals=False)
        t.fit(steps=5)
        states.append(t.model.state_dict())
        if spec:
            assert t._meta["checkpoint_activations"] == ["blocks.0", "blocks.1", "blocks.2"]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def _saved_bytes(net, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    loss_fn(out, torch.zeros(out.shape)).backward()
    return total


def test_checkpointing_saves_activations_and_recomputes_under_autocast():
    x = torch.randn(64, 8)
    plain = _saved_bytes(build(), x)
    net = build()
    checkpoint_blocks(net, "auto")
    dtypes = []
    net.blocks[0].fc1.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    checked = _saved_bytes(net, x)
    # Each block keeps only its input (and the checkpoint's own bookkeeping) instead of every intermediate.
    assert checked < 0.5 * plain, (checked, plain)
    assert dtypes == [torch.bfloat16, torch.bfloat16]       # forward, then the recompute, both under autocast


def test_the_watch_records_each_block_once(tmp_path):
    events = {}
    for spec in (None, "auto"):
        trace = tmp_path / f"{spec}.jsonl"
        torch.manual_seed(7)
        Trainer(build(), loss_fn, data, dtype="float16", checkpoint_activations=spec, trace=trace, trace_every=1,
                handle_signals=False).fit(steps=3)
        events[spec] = [e for e in read_trace(trace)[0] if e["event"] in ("stats", "nonfinite")]
    assert events[None] and events[None] == events["auto"]


def test_cli_flag(tmp_path):
    trace = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["train", str(SAMPLES / "char_transformer.py"), "--steps", "2",
                                 "--checkpoint-activations", "auto", "--trace", str(trace)])
    assert r.exit_code == 0, r.output
    assert read_trace(trace)[0][0]["checkpoint_activations"] == ["blocks.0", "blocks.1"]
    r = CliRunner().invoke(app, ["train", str(SAMPLES / "char_transformer.py"), "--steps", "1",
                                 "--checkpoint-activations", "Nope"])
    assert r.exit_code == 2 and "no module of class Nope" in r.output and "Traceback" not in r.output
