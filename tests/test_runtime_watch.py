"""ampaudit.watch inside ordinary training loops: non-finite origins, statistics, skips, hooks, trace."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn as nn

from ampaudit.runtime.trace import TraceWriter, read_trace
from ampaudit.runtime.watch import NonFiniteError, Watch, watch
from trace_events import ev

from conftest import load_planted


def train(planted, model, w: Watch, steps: int, *, autocast: bool = True, half: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(itertools.islice(planted.train_data(), steps)):
        w.set_step(step)
        x = x if isinstance(x, tuple) else (x,)
        if half:
            x = tuple(t.half() if t.is_floating_point() else t for t in x)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = model(*x)
        loss = planted.loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        w.after_backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            opt.step()


def hook_count(model: nn.Module) -> int:
    """The model's module hooks plus the process-wide ones (a divergence check records with a global hook)."""
    from torch.nn.modules import module as M
    return (sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
            + len(M._global_forward_hooks) + len(M._global_forward_pre_hooks))


@pytest.mark.parametrize("name", ["mask_fill", "gelu_cube", "cumsum_pool"])
def test_first_nonfinite_event_names_culprit_in_a_loop(name):
    planted = load_planted(name)
    model = planted.build_model()
    with watch(model, every=2) as w:
        train(planted, model, w, 3)
    assert w.nonfinite, f"{name}: no nonfinite event"
    first = w.nonfinite[0]
    assert first["module"] == planted.EXPECT["culprit"]
    assert first["phase"] == "forward" and first["step"] == 0 and f"{name}.py:" in first["source"]


def test_forward_that_raises_is_recorded_when_the_loop_exits():
    planted = load_planted("mask_fill_crash")
    model = planted.build_model()
    with pytest.raises(RuntimeError, match="overflow"):
        with watch(model) as w:
            train(planted, model, w, 1)
    assert w.nonfinite and w.nonfinite[0]["kind"] == "error" and w.nonfinite[0]["module"] == "attn"
    assert hook_count(model) == 0


def test_tiny_grads_backward_stats_show_gradients_flushing_to_zero():
    planted = load_planted("tiny_grads")
    model = planted.build_model().half()            # fp16 training, no loss scaling
    with watch(model, every=2) as w:
        train(planted, model, w, 2, autocast=False, half=True)
    stats = [e for e in w.events if e["event"] == "stats"]
    back = {e["module"]: e for e in stats if e["phase"] == "backward"}
    fwd = {e["module"]: e for e in stats if e["phase"] == "forward"}
    for name in ("head", "body.2", "body.0"):
        assert back[name]["zeros"] == back[name]["numel"] > 0, name        # every gradient flushed
        assert back[name]["absmax"] == 0.0
        assert fwd[name]["zeros"] < fwd[name]["numel"], name               # activations are fine
    # In fp32 the same loss gives nonzero gradients: the zeros come from fp16, not from the model.
    ref = planted.build_model()
    x, y = next(iter(planted.train_data()))
    planted.loss_fn(ref(x), y).backward()
    assert ref.head.weight.grad.abs().max() > 0


def test_tiny_grads_under_autocast_counts_underflow_at_the_output():
    planted = load_planted("tiny_grads")
    model = planted.build_model()
    with watch(model, every=1) as w:
        train(planted, model, w, 1)
        w.flush()
    top = [e for e in w.events if e["event"] == "stats" and e["phase"] == "backward" and e["module"] == "head"]
    assert top and top[0]["zeros"] == top[0]["numel"]


def test_close_removes_every_hook_and_stops_recording():
    planted = load_planted("gelu_cube")
    model = planted.build_model()
    before = hook_count(model)
    w = watch(model, every=1, divergence_every=1)
    assert hook_count(model) > before
    train(planted, model, w, 2)
    w.close()
    assert hook_count(model) == before
    assert all(not p._backward_hooks for p in model.parameters())
    n = len(w.events)
    train(planted, model, w, 1)
    assert len(w.events) == n


def test_divergence_events_are_sane_for_a_benign_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, every=10, divergence_every=2, dtype=torch.bfloat16) as w:
        for step in range(3):
            x = torch.randn(8, 16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = out.float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    div = w.divergence
    assert {e["step"] for e in div} == {0, 2}
    scopes = {(e["module"], e["scope"]) for e in div if e["step"] == 0}
    assert ("0", "global") in scopes and ("3", "local") in scopes and ("", "global") in scopes
    for e in div:
        assert 0.99 < e["cosine"] <= 1.0 + 1e-6, e
        assert 0.0 <= e["rel_l2"] < 0.05, e
        assert e["sqnr_db"] > 20, e
    grads = [e for e in div if e["scope"] == "grad"]
    assert {e["param"] for e in grads} == {"0.weight", "0.bias", "3.weight", "3.bias"}
    # Dropout masks are the same in the shadow: otherwise the global error would be huge.
    assert max(e["rel_l2"] for e in div if e["module"] == "" and e["scope"] == "global") < 0.05


def test_statistics_are_sampled_but_nonfinite_is_checked_every_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with watch(model, every=100, stats_every=3, locate_first=False) as w:
        for step in range(7):
            x = torch.randn(2, 4)
            if step == 5:
                x[0, 0] = float("nan")                  # an unsampled pass (5 % 3 != 0)
            model(x).sum().backward()
        w.flush()
    stats = {(e["module"], e["phase"]): e for e in w.events if e["event"] == "stats"}
    assert stats[("0", "forward")]["passes"] == 3           # passes 0, 3, 6
    assert stats[("0", "forward")]["counted_passes"] == 1   # exact counts on the first sampled pass
    located = w.nonfinite
    assert located and located[0]["step"] == 5 and located[0]["cause"] == "input"


def test_skip_attribution_names_parameter_with_injected_inf():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with watch(model, locate_first=False) as w:
        model(torch.randn(2, 4)).sum().backward()
        model[2].weight.grad[0, 1] = float("inf")
        result = w.on_skipped_step(65536.0)
    assert result == {"params": ["2.weight"], "modules": ["2"]}
    skip = next(e for e in w.events if e["event"] == "skip")
    assert skip["scale"] == 65536.0 and skip["params"] == ["2.weight"]


def test_raise_on_nonfinite_raises_from_backward_after_writing_the_event():
    planted = load_planted("mask_fill")
    model = planted.build_model()
    w = watch(model, raise_on_nonfinite=True)
    with pytest.raises(NonFiniteError, match="attn"):
        train(planted, model, w, 1)
    w.close()
    assert w.nonfinite[0]["module"] == "attn"


def test_trace_file_and_truncated_last_line(tmp_path):
    planted = load_planted("gelu_cube")
    model = planted.build_model()
    path = tmp_path / "run.jsonl"
    with watch(model, trace=path, every=2, divergence_every=2, stats_every=1) as w:
        train(planted, model, w, 4)
    events, problems = read_trace(path)
    assert not problems
    assert events[0]["event"] == "meta" and events[0]["source"] == "watch" and events[0]["dtype"] == "float16"
    kinds = {e["event"] for e in events}
    assert {"stats", "nonfinite", "divergence"} <= kinds
    stats = [e for e in events if e["event"] == "stats"]
    assert {e["step"] for e in stats} == {1, 3}
    for rec in stats:
        for key in ("module", "phase", "absmax", "min_nonzero", "inf", "nan", "zeros", "subnormal", "numel",
                    "headroom_bits"):
            assert rec[key] is not None or key == "min_nonzero", (key, rec)
    assert all(json.loads(line) for line in path.read_text().splitlines())
    text = path.read_text()
    path.write_text(text + '{"event": "stats", "step": 9, "mod')           # killed mid-write
    events2, problems2 = read_trace(path)
    assert len(events2) == len(events) and len(problems2) == 1 and "truncated" in problems2[0]


def test_shared_trace_writer_gets_no_meta_line(tmp_path):
    path = tmp_path / "shared.jsonl"
    model = nn.Linear(3, 3)
    with TraceWriter(path) as tw:
        tw.write_record(ev("meta", version=1, source="train"))
        with watch(model, trace=tw, every=1, locate_first=False):
            model(torch.randn(2, 3)).sum().backward()
        tw.write_record(ev("step", 0, loss=1.0))
    events, _ = read_trace(path)
    assert [e["event"] for e in events].count("meta") == 1
    assert events[-1]["event"] == "step"


def test_bad_arguments_are_usage_errors():
    from ampaudit.errors import UsageError
    with pytest.raises(UsageError):
        watch(nn.Linear(2, 2), every=0)
    with pytest.raises(UsageError):
        watch("not a model")
    with pytest.raises(UsageError):
        watch(nn.Linear(2, 2), dtype=torch.int8)


def test_ddp_wrapped_model_is_unwrapped_for_names(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        planted = load_planted("mask_fill")
        inner = planted.build_model()
        model = nn.parallel.DistributedDataParallel(inner)
        before = hook_count(inner)
        with watch(model, every=1, divergence_every=1) as w:
            train(planted, model, w, 1)
        assert w.nonfinite[0]["module"] == "attn"
        assert hook_count(inner) == before
    finally:
        dist.destroy_process_group()


from _shared_models import BackwardOverflow as _BackwardOverflow
from _shared_models import MaskedLogBuckets


def _skipping_loop(model, init_scale, **watch_kw):
    # A user's loop: fp16 autocast, a GradScaler, the watch told of each skipped step.
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, stats_every=1000, locate_first=False, **watch_kw) as w:
        for step in range(2):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 8) * 1e-4)
            opt.zero_grad()
            scaler.scale(out.float().sum()).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                w.on_skipped_step(scale)
    return [e for e in w.nonfinite if e["phase"] == "backward"]


class _HugeBoost(nn.Module):
    def forward(self, x):
        return x * 1e6             # the backward multiplies gradients by 1e6: past fp16's max even unscaled


def test_an_overflow_only_the_loss_scale_makes_is_the_scalers_probing():
    # Boost's backward overflows at scale 1000 but not unscaled: the event is still located, marked scaled_only.
    torch.manual_seed(0)
    back = _skipping_loop(_BackwardOverflow(), 1000.0, scaler=None)
    assert back and back[0]["module"] == "boost" and "scaled_only" not in back[0]   # scale unknown: no verdict
    torch.manual_seed(0)
    model = _BackwardOverflow()
    scaler_back = _skipping_loop(model, 1000.0, scaler=torch.amp.GradScaler("cpu", init_scale=1000.0))
    assert scaler_back and scaler_back[0]["module"] == "boost" and scaler_back[0]["scaled_only"] is True
    # A gradient past fp16's max even unscaled (no tanh to damp it) stays the module's fault.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), _HugeBoost(), nn.Linear(8, 1))
    w_back = _skipping_loop(model, 2.0, scaler=torch.amp.GradScaler("cpu", init_scale=2.0))
    assert w_back and w_back[0]["module"] == "1" and w_back[0]["scaled_only"] is False


def _hand_scaled_loop(said: dict[int, float]):
    # A loop that scales its loss by hand, 2 at step 0 and 1000 at step 1, telling the watch only `said`.
    torch.manual_seed(0)
    with watch(_BackwardOverflow(), stats_every=1, locate_first=False) as w:
        for step, scale in enumerate((2.0, 1000.0)):
            w.set_step(step)
            if step in said:
                w.set_loss_scale(said[step])
            with torch.autocast("cpu", dtype=torch.float16):
                out = w.root(torch.randn(4, 8) * 1e-4)
            w.root.zero_grad()
            (out.float().sum() * scale).backward()
    return [e for e in w.nonfinite if e["phase"] == "backward"]


def test_a_loss_scale_applies_to_the_step_it_is_said_for():
    # Said for step 1 itself: its overflow is the scale's. Said for step 0 only: step 1's scale is unknown, so
    # no verdict (step 0's scale of 2 is not step 1's, and dividing by it would call the overflow boost's fault).
    told = _hand_scaled_loop({0: 2.0, 1: 1000.0})
    assert told and told[0]["step"] == 1 and told[0]["scaled_only"] is True
    stale = _hand_scaled_loop({0: 2.0})
    assert stale and stale[0]["step"] == 1 and "scaled_only" not in stale[0]


def test_skipped_step_replays_and_locates_a_backward_overflow():
    torch.manual_seed(0)
    model = _BackwardOverflow()
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, stats_every=1000, locate_first=False, scaler=scaler) as w:
        for step in range(2):                  # pass 0 is sampled; pass 1 relies on the skip
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 8) * 1e-4)
            opt.zero_grad()
            scaler.scale(out.float().sum()).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                info = w.on_skipped_step(scale)
                assert "inp.weight" in info["params"]
    back = [e for e in w.nonfinite if e["phase"] == "backward"]
    assert back and back[0]["module"] == "boost" and back[0]["cause"] == "op"
    # Unscaled (divided by 1000) the gradient fits fp16: the scaler's probing, not boost's fault.
    assert back[0]["fp32_too"] is False and back[0]["scaled_only"] is True


def test_eval_loop_inside_autocast_locates_an_overflowing_weight_cast():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = 1e5                 # fits fp32, not fp16: the autocast cast overflows
    with watch(model) as w:
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
            model(torch.randn(2, 4))
    first = w.nonfinite[0]
    assert first["module"] == "1" and first["op"] == "aten._to_copy" and first["cause"] == "op"


def test_an_overflow_inside_the_loss_trips_the_flag_on_a_later_pass():
    # The model's outputs stay finite; only d loss / d output is inf. Such a pass ends in the gradient hook
    # on most steps: this one must still be replayed, and the inf traced back to where it entered.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with watch(model, every=100, stats=False, locate_first=False) as w:
        for step in range(4):
            out = model(torch.randn(2, 4))
            scale = 1e38 * 1e38 if step == 2 else 1.0        # fp32: inf
            (out.pow(2).sum() * scale).backward()
    located = w.nonfinite
    assert located and {e["step"] for e in located} == {2}
    assert located[0]["phase"] == "backward" and located[0]["cause"] == "input"


def test_any_nonfinite_reads_each_value():
    from ampaudit.runtime.stats import any_nonfinite
    assert any_nonfinite([]) is False
    assert any_nonfinite([torch.tensor(1.0), torch.tensor(-3e38)]) is False
    assert any_nonfinite([torch.tensor(1.0), torch.tensor(float("-inf"))]) is True
    assert any_nonfinite([torch.tensor(float("nan"), dtype=torch.bfloat16)]) is True


def test_watch_rejects_a_bool_where_a_count_is_expected():
    from ampaudit.errors import UsageError
    with pytest.raises(UsageError, match="every must be a positive integer"):
        watch(nn.Linear(2, 2), every=True)


def test_only_cpu_passes_end_early_in_the_gradient_hook():
    # On CUDA a read at the start of backward would stall the kernel queue: the flag waits for the end of
    # the backward there. (No GPU here: the device type is set by hand; every op still runs on CPU.)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    seen = {}
    for device in ("cpu", "cuda"):
        with watch(model, stats=False, locate_first=False) as w:
            w.device_type = device
            out = model(torch.randn(2, 4))
            seen[device] = w._pass.lean
            out.sum().backward()
            assert not w._pass.open                       # ended either way, before any optimizer step
    assert seen == {"cpu": True, "cuda": False}


def test_a_forward_that_raises_later_is_located_and_not_compared_with_fp32():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if x[0, 0] == 123.0:                          # this batch fails, and fails again when replayed
                raise ValueError("bad batch")
            return y

    model = Flaky()
    with watch(model, stats=False, locate_first=False, divergence_every=1, dtype=torch.bfloat16) as w:
        for step in range(4):
            w.set_step(step)
            x = torch.randn(2, 4)
            x[0, 0] = 123.0 if step == 2 else 0.5
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
            except ValueError:
                continue
            out.float().sum().backward()
    errors = [e for e in w.nonfinite if e["kind"] == "error"]
    assert [e["step"] for e in errors] == [2] and "bad batch" in errors[0]["message"]
    assert {e["step"] for e in w.divergence} == {0, 1, 3}         # the failed pass has no FP32 comparison
    assert hook_count(model) == 0                                  # the check's global hook went with it


def test_the_first_pass_replay_ignores_an_inf_an_fp32_op_makes_and_masks():
    # T5's relative-position buckets take log(0) in FP32 and mask the -inf right away: not a precision fault.
    model = MaskedLogBuckets(4)
    with watch(model, dtype=torch.bfloat16) as w:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4)).float().sum().backward()
    assert w.nonfinite == []
    # The op-level record still says where the inf came from, and that it was an FP32 op.
    from ampaudit.runtime.locate import locate_nonfinite
    events = locate_nonfinite(model, (torch.randn(2, 4),), dtype=torch.bfloat16)
    assert events and events[0]["op"] == "aten.log" and events[0]["low_precision"] is False


def test_a_tripped_flag_lists_low_precision_origins_before_fp32_ones():
    # A T5-like FP32 log(0) runs first, then an fp16 overflow reaches the output: the first event names the overflow.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.buckets = MaskedLogBuckets(4)
            self.boost = nn.Linear(4, 4)

        def forward(self, x):
            return self.boost(self.buckets(x)) * 1e5          # fp16: inf

    model = Net()
    with watch(model, stats=False, locate_first=False) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 4))
        out.float().sum().backward()
    assert w.nonfinite and w.nonfinite[0]["low_precision"] is True and w.nonfinite[0]["module"] == ""
    assert any(e["op"] == "aten.log" for e in w.nonfinite[1:])


def test_watch_is_the_class_so_every_option_reaches_it():
    """One signature: ``ampaudit.watch`` is ``Watch``, so options such as max_replays are not lost on the way."""
    import ampaudit
    from ampaudit.runtime.watch import Watch

    assert ampaudit.watch is Watch
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with ampaudit.watch(model, max_replays=0) as w:        # no replay, not even the first pass
        model(torch.randn(2, 4)).sum().backward()
        assert w._replays == 0
    with ampaudit.watch(model, max_replays=1) as w:
        model(torch.randn(2, 4)).sum().backward()
        assert w._replays == 1
    with pytest.raises(ampaudit.errors.UsageError, match="max_replays"):
        ampaudit.watch(model, max_replays=-1)


def test_float8_layers_give_no_spurious_nonfinite_events():
    """The locator replay runs torchao's Float8Linear too: its fp8 operands are storage, not checked values."""
    pytest.importorskip("torchao")
    from ampaudit.precision.fp8 import config, import_torchao

    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    import_torchao().convert_to_float8_training(model, config=config("tensorwise", emulate=True))
    with watch(model, dtype=torch.bfloat16) as w:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(16, 32))
        out.float().sum().backward()
    assert w.nonfinite == []
