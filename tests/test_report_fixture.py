"""The trace fixtures in tests/assets/report_*.jsonl, and the code that writes them.

A simulated fp16 run of 300 steps: a dynamic loss scaler that starts too high (three skipped steps while it backs
off to 2^13), grows every 50 good steps and overflows straight after, six modules with stats every 10 steps,
divergence vs FP32 every 50, and one forward overflow in ``blocks.1.attn`` (whose activations creep towards
float16's max and whose error vs FP32 grows). Regenerate with ``python tests/test_report_fixture.py``.
"""
from __future__ import annotations

import io
import math
import random
from pathlib import Path

from ampaudit.runtime.trace import TraceWriter
from trace_events import ev

ASSETS = Path(__file__).parent / "assets"
FP16_MAX = 65504.0
MODULES = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"]
CULPRIT = "blocks.1.attn"
OVERFLOW_STEP = 180


def _forward_absmax(module: str, step: int, rng: random.Random) -> float:
    if module == CULPRIT:  # creeps towards fp16's max: 2k at the start, ~40k at the end
        return 2000.0 * 20 ** (step / 300) * rng.uniform(0.9, 1.1)
    base = {"embed": 3.0, "blocks.0.attn": 40.0, "blocks.0.mlp": 120.0, "blocks.1.mlp": 300.0, "head": 15.0}
    return base[module] * rng.uniform(0.8, 1.2)


def _rel_l2(module: str, scope: str, step: int, rng: random.Random) -> float:
    local = {"embed": 0.0008, "blocks.0.attn": 0.003, "blocks.0.mlp": 0.004, "blocks.1.mlp": 0.012,
             "head": 0.002}.get(module)
    if local is None:  # the culprit: error it adds itself grows with its activations
        local = 0.004 * 25 ** (step / 300)
    if scope == "global":  # error carried from upstream adds to each module's own
        idx = MODULES.index(module)
        local = local + 0.002 * idx + (0.03 if idx > MODULES.index(CULPRIT) and step > 150 else 0.0)
    return local * rng.uniform(0.85, 1.15)


def write_run(path: Path, steps: int = 300, truncate_at: int | None = None) -> None:
    """Write the simulated run; ``truncate_at`` stops after that step and cuts the last line in half."""
    rng = random.Random(0)
    scale, good = 65536.0, 0
    with TraceWriter(path) as tw:
        put = tw.write_record
        put(ev("meta", None, version=1, source="train", dtype="float16", device="cuda", model="TinyTransformer",
               argv=["ampaudit", "train", "model.py", "--trace", "run.jsonl"]))
        for step in range(1, steps + 1):
            overflow_fwd = step == OVERFLOW_STEP
            # Unscaled gradients peak near 4: anything above 2^13 * 2 overflows in the scaled backward pass.
            grad_peak = 4.0 * rng.uniform(0.95, 1.05)
            skipped = overflow_fwd or grad_peak * scale > FP16_MAX
            loss = 2.3 * math.exp(-step / 120) + 0.5 + rng.gauss(0, 0.03)
            grad_norm = abs(rng.gauss(0.6, 0.15)) + (2.5 if rng.random() < 0.08 else 0.0)
            lr = 3e-4 * min(1.0, step / 20) * (0.5 + 0.5 * math.cos(math.pi * step / steps))
            if overflow_fwd:
                put(ev("nonfinite", step, phase="forward", module=CULPRIT, op="aten.exp.default",
                       source="model.py:42", kind="inf"))
            put(ev("step", step, loss=float("inf") if overflow_fwd else round(loss, 5), scale=scale,
                   skipped=skipped, grad_norm=float("inf") if skipped else round(grad_norm, 5),
                   clipped=not skipped and grad_norm > 1.0, lr=round(lr, 8),
                   time=round(0.05 + rng.uniform(0, 0.01), 5)))
            if skipped:
                mods = [CULPRIT] if overflow_fwd else ["blocks.1.attn", "blocks.1.mlp"]
                put(ev("skip", step, scale=scale, modules=mods, params=[f"{m}.weight" for m in mods]))
                scale, good = scale / 2, 0
            else:
                good += 1
                if good == 50:
                    scale, good = scale * 2, 0
            if step % 10 == 0:
                for m in MODULES:
                    fwd = _forward_absmax(m, step, rng)
                    numel = 8 * 128 * 64
                    put(ev("stats", step, module=m, phase="forward", absmax=round(fwd, 3),
                           min_nonzero=round(fwd * 1e-6, 9), inf=0, nan=0, zeros=rng.randint(0, 40),
                           subnormal=0, numel=numel, headroom_bits=round(math.log2(FP16_MAX / fwd), 4)))
                    bwd = 0.02 * rng.uniform(0.5, 2.0) * scale
                    sub = rng.randint(0, 200) if m == "embed" else 0
                    put(ev("stats", step, module=m, phase="backward", absmax=round(bwd, 3),
                           min_nonzero=5.96e-08, inf=0, nan=0, zeros=rng.randint(0, 400),
                           subnormal=sub, numel=numel, headroom_bits=round(math.log2(FP16_MAX / bwd), 4)))
            if step % 50 == 0:
                for m in MODULES:
                    for scope in ("local", "global"):
                        rel = _rel_l2(m, scope, step, rng)
                        put(ev("divergence", step, module=m, scope=scope, rel_l2=round(rel, 6),
                               cosine=round(1 - rel * rel / 2, 8), max_abs=round(rel * 30, 5),
                               sqnr_db=round(-20 * math.log10(rel), 3)))
                for m in (CULPRIT, "head"):
                    rel = _rel_l2(m, "local", step, rng) * 2
                    put(ev("divergence", step, module=m, scope="grad", param=f"{m}.weight",
                           rel_l2=round(rel, 6), cosine=round(1 - rel * rel / 2, 8), max_abs=None,
                           sqnr_db=round(-20 * math.log10(rel), 3)))
            if step % 100 == 0:
                put(ev("checkpoint", step, path=f"runs/ckpt-{step:06d}.pt"))
            if truncate_at is not None and step == truncate_at:
                break
    if truncate_at is not None:
        text = path.read_text()
        path.write_text(text[: len(text) - 25])


def write_corrupt(path: Path) -> None:
    """40 steps with a garbage line, an unknown event, missing and malformed fields, and a bf16 run. The
    malformed events are written as raw dicts, past the schema's constructor, which would refuse them."""
    buf = io.StringIO()
    with TraceWriter(buf) as tw:
        put, raw = tw.write_record, tw.write_record
        put(ev("meta", None, version=1, source="watch", dtype="bfloat16", device="cpu"))
        for step in range(1, 41):
            put(ev("step", step, loss=1.0 / step, scale=None, skipped=False, grad_norm=None, clipped=False))
            if step == 10:
                buf.write('{"event": "step", "step": 10, "loss": 0.1, "sca\x00\x00 garbage\n')
                tw.write("gpu_memory", step, bytes=123456)  # an event kind this reader does not know
                raw({"event": "stats", "step": step, "module": "fc", "phase": "forward"})  # no numbers at all
                raw({"event": "divergence", "step": step, "module": "fc", "rel_l2": "not a number", "cosine": None})
                raw({"event": "step", "step": None, "loss": "nan", "skipped": "yes"})  # no step, malformed fields
            if step == 20:
                raw({"event": "stats", "step": step, "module": "fc", "phase": "forward", "absmax": 3.0,
                     "headroom_bits": 126.4, "numel": 100, "subnormal": 1, "inf": 0, "nan": 0,
                     "unknown_field": [1, 2]})
                put(ev("nonfinite", step, module=None, kind="nan"))
    path.write_text(buf.getvalue())


def write_only_truncated(path: Path) -> None:
    """A run killed while writing its first line."""
    path.write_text('{"event":"meta","step":null,"version":1,"source":"tr')


WRITERS = {
    "report_run.jsonl": write_run,
    "report_truncated.jsonl": lambda p: write_run(p, truncate_at=120),
    "report_corrupt.jsonl": write_corrupt,
    "report_only_truncated.jsonl": write_only_truncated,
}


def test_assets_are_current(tmp_path):
    """The committed fixtures are what this file writes (so a reader of the code knows what is in them)."""
    for name, writer in WRITERS.items():
        writer(tmp_path / name)
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), f"regenerate {name}"


def test_run_fixture_is_realistic():
    text = (ASSETS / "report_run.jsonl").read_text()
    lines = text.splitlines()
    assert 600 < len(lines) < 1200
    assert sum('"event":"skip"' in ln for ln in lines) >= 5
    assert sum('"event":"nonfinite"' in ln for ln in lines) == 1


if __name__ == "__main__":
    ASSETS.mkdir(exist_ok=True)
    for _name, _writer in WRITERS.items():
        _writer(ASSETS / _name)
        print(f"wrote {ASSETS / _name}")
