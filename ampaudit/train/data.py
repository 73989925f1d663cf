"""The training-data stream: epochs, accumulation windows, the rank split, a resumable position, the micro-batch size.

``train_data()`` from the model file is called once per epoch and read in order. An optimizer step consumes one
*window* of ``world_size * accum`` consecutive batches; rank ``r`` takes batches ``r, r+W, r+2W, ...`` of it, so
``W`` processes with ``--accum K`` see exactly the batches one process with ``--accum W*K`` sees. Every rank reads
the whole stream (each keeps only its share), which keeps the ranks in lockstep without communication.

    stream = DataStream(train_data, accum=4, epochs=None)
    for batch in stream.window(): ...            # up to 4 micro-batches
    if not stream.complete: ...                  # data ran out: the partial window is dropped
    stream.position()                            # {"epoch": 0, "index": 4}, saved in checkpoints

The position counts batches read from the current epoch's iterator; resuming re-calls ``train_data()`` and skips
that many, so a ``train_data`` that draws from its own seeded ``torch.Generator`` resumes bit-identically.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ampaudit.errors import TrainError, UsageError

_END = object()


def as_factory(train_data: Any) -> Callable[[], Iterable]:
    """Accept a callable returning an iterable, or a re-iterable object (list, DataLoader)."""
    if callable(train_data) and not hasattr(train_data, "__iter__"):
        return train_data
    if isinstance(train_data, Iterator):
        raise TrainError("train_data is a one-shot iterator; it cannot be restarted for a new epoch or a resume",
                         hint="pass the function that creates it (train_data, not train_data())")
    if isinstance(train_data, Iterable):
        return lambda: train_data
    raise TrainError(f"train_data must be a function returning batches, got {type(train_data).__name__}",
                     hint="def train_data(): yield inputs, target")


class DataStream:
    """Yields this rank's micro-batches window by window, across epochs, from a resumable position."""

    def __init__(self, factory: Callable[[], Iterable], *, accum: int = 1, rank: int = 0, world_size: int = 1,
                 epochs: int | None = None):
        self._factory = factory
        self.accum = accum
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        self.epoch = 0
        self.index = 0
        self.complete = True
        self._iter: Iterator | None = None

    def position(self) -> dict[str, int]:
        """Where the next window starts: epoch number and batches already read from that epoch."""
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict[str, int]) -> None:
        """Continue from a saved :meth:`position` (the iterator is re-created and fast-forwarded lazily)."""
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
        self._iter = None

    def _open(self) -> Iterator:
        try:
            it = iter(self._factory())
        except TypeError as exc:
            raise TrainError(f"train_data() must return an iterable of (inputs, target), got: {exc}",
                             hint="def train_data(): yield inputs, target") from exc
        for skipped in range(self.index):
            if next(it, _END) is _END:
                raise TrainError(f"train_data() yields only {skipped} batches but the checkpoint stopped after "
                                 f"{self.index} of epoch {self.epoch}",
                                 hint="resume with the same data, or drop resume=True to start fresh")
        return it

    def _next(self) -> Any:
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                return _END
            if self._iter is None:
                self._iter = self._open()
            batch = next(self._iter, _END)
            if batch is not _END:
                self.index += 1
                return batch
            if self.index == 0:
                raise TrainError("train_data() yielded no batches", hint="make it yield (inputs, target) pairs")
            self.epoch, self.index, self._iter = self.epoch + 1, 0, None

    def window(self) -> Iterator[Any]:
        """This rank's micro-batches of the next window; sets :attr:`complete` once the window is read.

        The last micro-batch is held back until the whole window has been read, so no rank starts its boundary
        (gradient-synchronising) backward pass for a window that another rank cannot finish.
        """
        self.complete = False
        held = None
        for j in range(self.world_size * self.accum):
            batch = self._next()
            if batch is _END:
                return
            if j % self.world_size == self.rank:
                if j // self.world_size < self.accum - 1:
                    yield batch
                else:
                    held = batch
        self.complete = True
        yield held


def split_batch(batch: Any, device: torch.device) -> tuple[tuple, dict, Any]:
    """``(inputs, target)`` from ``train_data()`` as forward ``args``, ``kwargs`` and the target, on ``device``."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TrainError(f"train_data() must yield (inputs, target) pairs, got {type(batch).__name__}",
                         hint="yield x, y where x is a tensor, a tuple of tensors or a dict")
    inputs, target = batch
    if device.type != "cpu":
        inputs, target = _to(inputs, device), _to(target, device)
    if isinstance(inputs, dict):
        return (), inputs, target
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}, target
    return (inputs,), {}, target


def batch_size(batch: Any) -> int:
    """The micro-batch size of a ``(inputs, target)`` pair: the leading dimension of its first tensor."""
    def first(value: Any) -> torch.Tensor | None:
        if isinstance(value, torch.Tensor):
            return value if value.dim() > 0 else None
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        for item in items:
            found = first(item)
            if found is not None:
                return found
        return None

    found = first(batch)
    if found is None:
        raise TrainError("cannot tell the micro-batch size: the first batch of train_data() holds no batched tensor",
                         hint="pass micro_batch=N to the Trainer, or drop scale_lr")
    return int(found.shape[0])


def first_batch(factory: Any) -> Any:
    """The first batch ``factory()`` yields, or None (read before training starts; the RNG states are restored
    after it, so a ``train_data`` drawing from the global generators trains as it would)."""
    from ampaudit.runtime.replay_state import rng_kept

    with rng_kept():
        return next(iter(factory()), None)


def first_batch_size(factory: Any) -> int:
    """The micro-batch size of the first batch ``factory()`` yields (:func:`first_batch`)."""
    batch = first_batch(factory)
    if batch is None:
        raise TrainError("train_data() yielded no batches", hint="make it yield (inputs, target) pairs")
    return batch_size(batch)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The training device: ``device``, else cuda when available, else cpu; a bad name is a UsageError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"unknown device {device!r}", hint="use cpu or cuda") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("cuda requested but no CUDA device is available", hint='use device="cpu"')
    return dev


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value
