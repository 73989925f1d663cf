"""Every runnable model file in samples/ follows the model-file protocol and trains in fp32, bf16 and fp16.

Samples are discovered with a glob, so a new sample is covered as soon as it lands. A sample may carry an
``EXPECT`` dict (as the planted faults do); when its ``culprit`` is not None the sample is meant to fail in low
precision, and the autocast tests only require that the step runs. ``EXPECT["cpu_fp16_unsupported"]`` names a
kernel some CPUs lack in fp16: the fp16 autocast step is then skipped where the probe of
ampaudit.machine.kernels says this CPU lacks it (AMPAUDIT_FORCE_NO_FP16_KERNELS forces the answer), and must run
where it says the CPU has it.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.fx

from conftest import cpu_fp16_gap

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
SAMPLE_PATHS = sorted(p for p in SAMPLES_DIR.glob("*.py") if not p.name.startswith("_"))
REQUIRED = ("build_model", "example_inputs", "train_data", "loss_fn")
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def load_sample(path: Path) -> ModuleType:
    """Import a sample from its path under a private module name (samples/ is not a package)."""
    name = f"_ampaudit_sample_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def as_args(inputs) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def call(model: torch.nn.Module, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*as_args(inputs))


def expects_fault(module: ModuleType) -> bool:
    return getattr(module, "EXPECT", {}).get("culprit") is not None


def tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in tensors(item)]
    return []


def two_batches(module: ModuleType) -> list:
    return list(itertools.islice(module.train_data(), 2))


@pytest.fixture(params=SAMPLE_PATHS, ids=[p.stem for p in SAMPLE_PATHS])
def sample(request) -> ModuleType:
    return load_sample(request.param)


def test_expected_samples_exist():
    names = {p.stem for p in SAMPLE_PATHS}
    assert {"char_transformer", "resnet_bn", "lstm_forecaster", "misaligned_mlp", "clean_mlp"} <= names


def test_protocol_and_docstring(sample):
    missing = [name for name in REQUIRED if not callable(getattr(sample, name, None))]
    assert not missing, f"{sample.__file__} lacks {missing}"
    doc = sample.__doc__ or ""
    assert len(doc) > 80 and "finding" in doc.lower(), "docstring must say what it shows and what it finds"
    assert isinstance(sample.example_inputs(), tuple)


def test_forward_fp32_finite(sample):
    model = sample.build_model()
    out = call(model, sample.example_inputs())
    outs = tensors(out)
    assert outs and all(torch.isfinite(t).all() for t in outs if t.is_floating_point())


def test_seeded(sample):
    a, b = sample.build_model(), sample.build_model()
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), f"build_model is not seeded: {name} differs between calls"
    first, second = next(iter(sample.train_data())), next(iter(sample.train_data()))
    for x, y in zip(tensors(first), tensors(second)):
        assert torch.equal(x, y), "train_data is not seeded"


def test_train_two_batches_fp32(sample):
    model = sample.build_model()
    make_opt = getattr(sample, "make_optimizer", None)
    opt = make_opt(model.parameters()) if make_opt else torch.optim.AdamW(model.parameters())
    batches = two_batches(sample)
    assert len(batches) == 2
    for inputs, target in batches:
        loss = sample.loss_fn(call(model, inputs), target)
        assert loss.dim() == 0 and loss.dtype == torch.float32 and math.isfinite(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        opt.step()


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_autocast_step_runs(sample, dtype):
    gap = cpu_fp16_gap(sample, grad=True) if dtype == torch.float16 else None
    if gap:
        pytest.skip(gap)
    model = sample.build_model()
    inputs, target = next(iter(sample.train_data()))
    with torch.autocast("cpu", dtype=dtype):
        out = call(model, inputs)
        loss = sample.loss_fn(out, target)
    if dtype == torch.float16:
        # fp16 without master weights needs loss scaling; GradScaler works on CPU too.
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(loss).backward()
    else:
        loss.backward()
    if not expects_fault(sample):
        assert math.isfinite(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fx_traceable(sample):
    if getattr(sample, "EXPECT", {}).get("capture", "fx") != "fx":
        pytest.skip("sample is meant to need a fallback capture")
    model = sample.build_model()
    graph_module = torch.fx.symbolic_trace(model)
    inputs = sample.example_inputs()
    torch.testing.assert_close(call(graph_module, inputs), call(model, inputs))
