"""Step time of Lightning ``fit`` and Hugging Face ``Trainer.train`` with no hooks, with ``ampaudit.watch``
attached directly, and with the ampaudit callback, side by side.

    python bench/callbacks_overhead.py                          # both frameworks, 60 timed steps x 3 rounds
    python bench/callbacks_overhead.py --framework lightning --steps 100 --rounds 5
    python bench/callbacks_overhead.py --divergence-every 50    # FP32 shadow checks too (watch and callback)

Three runs per framework train identical copies of one model on the same batches, on CPU under bf16 autocast:

  none      no hooks (the baseline)
  watch     ampaudit.watch(model, every=N) attached before training, no callback
  callback  the integration's AmpAuditCallback(every=N): the same watch plus a ``step`` event per optimizer step
            (loss, scale, skipped, grad norm from one fused pass over the gradients, lr, time)

A step is timed from the first ``on_train_batch_start``/``on_step_begin`` hook to the last
``on_train_batch_end``/``on_step_end`` hook (forward, backward, optimizer step and every callback in between;
data loading and logging outside it). The first ``--warmup`` steps of each run are not timed (they hold the
watch's one-off replay of the first step under the op-level locator). Runs take turns, round by round, so load
from other processes falls on all of them alike; the median over all timed steps is compared (the mean, shown
beside it, holds the rare divergence steps). Times are CPU seconds of this process (one torch thread): on a
shared machine wall time mostly measures the neighbours. With Hugging Face, accelerate enters autocast inside
``forward``, where a directly attached watch cannot see it: its ``watch`` run skips the divergence checks that
the callback (which moves autocast around the call) really runs.

Target: callback <= watch x 1.05 (the callback adds no more step time than the watch itself).
Exit status 0 when every framework meets it, 1 otherwise.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampaudit.runtime.watch import watch  # noqa: E402

TARGET = 1.05
CONDITIONS = ("none", "watch", "callback")


class StepClock:
    """Per-step CPU and wall seconds, from ``start()`` to ``stop()``; the first ``warmup`` steps are dropped."""

    def __init__(self, warmup: int):
        self.warmup, self.cpu, self.wall, self._seen = warmup, [], [], 0
        self._t0: tuple[float, float] | None = None

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = (time.process_time(), time.perf_counter())

    def stop(self) -> None:
        if self._t0 is None:
            return
        cpu0, wall0 = self._t0
        self._t0 = None
        self._seen += 1
        if self._seen > self.warmup:
            self.cpu.append(time.process_time() - cpu0)
            self.wall.append(time.perf_counter() - wall0)


# --- Lightning -----------------------------------------------------------------------------------------
def lightning_run(condition: str, base: nn.Module, data: list, steps: int, every: int, div: int | None,
                  clock: StepClock) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from ampaudit.integrations.lightning import AmpAuditCallback

    class Module(L.LightningModule):
        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Start(Callback):
        def on_train_batch_start(self, *args):
            clock.start()

    class Stop(Callback):
        def on_train_batch_end(self, *args):
            clock.stop()

    module = Module(copy.deepcopy(base))
    middle = [AmpAuditCallback(every=every, divergence_every=div)] if condition == "callback" else []
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Start(), *middle, Stop()])
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    w = watch(module, every=every, divergence_every=div, dtype=torch.bfloat16) if condition == "watch" else None
    try:
        trainer.fit(module, loader)
    finally:
        if w is not None:
            w.close()


def lightning_setup(batch: int) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    width = 256
    blocks = []
    for _ in range(4):
        blocks += [nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    net = nn.Sequential(nn.Linear(64, width), *blocks, nn.Linear(width, 16))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 64, generator=g), torch.randint(0, 16, (batch,), generator=g)) for _ in range(64)]
    return net, data


# --- Hugging Face --------------------------------------------------------------------------------------
def transformers_run(condition: str, base: nn.Module, data: list, steps: int, every: int, div: int | None,
                     clock: StepClock) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ampaudit.integrations.transformers import AmpAuditCallback

    class Start(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            clock.start()

    class Stop(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            clock.stop()

    model = copy.deepcopy(base)
    middle = [AmpAuditCallback(every=every, divergence_every=div)] if condition == "callback" else []
    args = TrainingArguments(output_dir=os.path.join("/tmp", "ampaudit-bench-hf"), max_steps=steps,
                             per_device_train_batch_size=8, bf16=True, use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Start(), *middle, Stop()])
    w = watch(model, every=every, divergence_every=div, dtype=torch.bfloat16) if condition == "watch" else None
    try:
        trainer.train()
    finally:
        if w is not None:
            w.close()


def transformers_setup(batch: int) -> tuple[nn.Module, list]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(512):
        ids = torch.randint(0, 512, (64,), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return model, data


FRAMEWORKS = {"lightning": (lightning_setup, lightning_run), "transformers": (transformers_setup, transformers_run)}


def bench(name: str, args: argparse.Namespace) -> bool:
    setup, run = FRAMEWORKS[name]
    base, data = setup(args.batch)
    clocks = {c: StepClock(args.warmup) for c in CONDITIONS}
    for _ in range(args.rounds):
        for condition in CONDITIONS:
            clock = clocks[condition]
            clock._seen = 0
            run(condition, base, data, args.steps + args.warmup, args.every, args.divergence_every, clock)
    med = {c: statistics.median(clocks[c].cpu) * 1e3 for c in CONDITIONS}
    mean = {c: statistics.fmean(clocks[c].cpu) * 1e3 for c in CONDITIONS}     # holds the rare divergence steps
    wall = {c: statistics.median(clocks[c].wall) * 1e3 for c in CONDITIONS}
    print(f"\n{name}: {len(clocks['none'].cpu)} timed steps per run type, every={args.every}, "
          f"divergence_every={args.divergence_every}")
    print(f"  {'run':<10}{'CPU ms/step':>12}{'(mean)':>9}{'wall ms/step':>14}{'vs none':>9}{'vs watch':>10}")
    for c in CONDITIONS:
        print(f"  {c:<10}{med[c]:>12.2f}{mean[c]:>9.2f}{wall[c]:>14.2f}{med[c] / med['none']:>8.3f}x"
              f"{med[c] / med['watch']:>9.3f}x")
    ok = med["callback"] <= med["watch"] * TARGET
    print(f"  callback / watch = {med['callback'] / med['watch']:.3f}x (target <= {TARGET:.2f}x): "
          f"{'ok' if ok else 'MISSED'}")
    return ok


def torchvision_importable() -> None:
    """lightning (through torchmetrics) and transformers import torchvision when it is installed; a CUDA build
    beside a CPU torch cannot load its extension, and coverage_tvops makes it importable (as bench/coverage.py)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from coverage_tvops import import_torchvision

        import_torchvision()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=[*FRAMEWORKS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per condition, interleaved")
    parser.add_argument("--every", type=int, default=50, help="watch statistics interval")
    parser.add_argument("--divergence-every", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64, help="Lightning batch size")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torchvision_importable()
    names = list(FRAMEWORKS) if args.framework == "both" else [args.framework]
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU bf16 autocast")
    results = [bench(n, args) for n in names]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
