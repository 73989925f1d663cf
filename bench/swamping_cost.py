"""What measuring swamping costs (ampaudit.runtime.swamping): a step the meter measures against one it does not.

    python bench/swamping_cost.py                  # sample transformer, O2-style bf16 weights, a bf16 EMA teacher
    python bench/swamping_cost.py --steps 60 --json out.json

The sample transformer (samples/char_transformer.py) is cast to bf16 with FP32 masters stepped by AdamW, as O2
does, and a bf16 copy of it is moved towards it after each step by an EMA (momentum 0.999): the state the meter
exists for. One loop, a WatchSession with ``every=2``: every other step is measured (the dispatch mode over the
whole step, the EMA's writes rerun in FP32), the others are not. Times are CPU seconds of this process
(``time.process_time``, one torch thread); the ratio is the median measured step over the median unmeasured one,
and ``amortized`` what that adds at the default ``every=50`` (1 + (ratio - 1) / 50). No target: the watch's cost
targets (bench/watch_overhead.py) are on models without low-precision state, where no step is measured.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.loading import load_target
from ampaudit.runtime.session import WatchSession


def run(steps: int) -> dict:
    loaded = load_target(str(ROOT / "samples" / "char_transformer.py"), need_inputs=False)
    train_data, loss_fn = loaded.hook("train_data"), loaded.hook("loss_fn")
    model = loaded.model.to(torch.bfloat16)
    teacher = copy.deepcopy(model).requires_grad_(False)
    masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    holder = torch.nn.ModuleDict({"student": model, "teacher": teacher})
    session = WatchSession(every=2, replays=False)
    session.start(holder, dtype=torch.bfloat16, integration="bench")
    session.measure_updates(optimizer=opt, mastered=list(model.parameters()))
    data = iter(train_data())
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(1, steps + 1):
        x, y = next(data)
        t0 = time.process_time()
        session.begin_step(step)
        measured = session.swamp is not None and session.swamp.active
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        for p, m in zip(model.parameters(), masters):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(list(model.parameters()), masters)
            torch._foreach_lerp_(list(teacher.parameters()), list(model.parameters()), 1e-3)
        session.end_step(skipped=False, scale=None)
        if step > 4:            # the first steps allocate and warm up
            times[measured].append(time.process_time() - t0)
    events = [e for e in session.events if e["event"] == "swamping"]
    session.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"steps": steps, "measured_step_s": on, "unmeasured_step_s": off, "ratio": on / off,
            "amortized_every_50": 1 + (on / off - 1) / 50, "swamping_events": len(events),
            "tensors": sorted({e["tensor"] for e in events})[:5]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.steps)
    print(f"measured step {result['measured_step_s'] * 1e3:.1f} ms, unmeasured {result['unmeasured_step_s'] * 1e3:.1f}"
          f" ms: {result['ratio']:.2f}x on a measured step, {result['amortized_every_50']:.3f}x amortized at "
          f"every=50; {result['swamping_events']} swamping events (e.g. {', '.join(result['tensors'])})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
