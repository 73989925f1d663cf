"""`ampaudit train` without --dtype trains in the dtype the device multiplies natively, and says so first."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.errors import UsageError
from ampaudit.machine import train_dtype
from conftest import ASSETS


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(train_dtype.ENV, raising=False)


@pytest.mark.parametrize("flags, expect", [
    (["avx512_bf16", "avx512_fp16"], ("bfloat16", "AVX512-BF16")),
    (["amx_bf16"], ("bfloat16", "AMX-BF16")),
    (["avx512_fp16"], ("float16", "AVX512-FP16")),
    ([], ("float16", "neither native bf16 nor fp16")),
])
def test_cpu_default_follows_the_flags(unpinned, monkeypatch, flags, expect):
    import ampaudit.machine.facts as facts

    monkeypatch.setattr(facts, "cpu_facts", lambda: {"flags": flags})
    name, why = train_dtype.default_train_dtype("cpu")
    assert name == expect[0] and expect[1] in why


@pytest.mark.parametrize("cc, expect", [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16")])
def test_cuda_default_follows_the_compute_capability(unpinned, monkeypatch, cc, expect):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    name, why = train_dtype.default_train_dtype("cuda")
    assert name == expect and f"sm_{cc[0]}{cc[1]}" in why


def test_the_environment_pins_it(monkeypatch):
    monkeypatch.setenv(train_dtype.ENV, "bfloat16")
    assert train_dtype.default_train_dtype("cpu") == ("bfloat16", f"set by {train_dtype.ENV}")
    monkeypatch.setenv(train_dtype.ENV, "float7")
    with pytest.raises(UsageError, match="is not a training dtype"):
        train_dtype.default_train_dtype("cpu")


def test_train_states_the_default_first(unpinned, monkeypatch):
    import ampaudit.machine.facts as facts

    monkeypatch.setattr(facts, "cpu_facts", lambda: {"flags": ["avx512_bf16"]})
    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "1", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == ("dtype bfloat16: this CPU multiplies bf16 natively (AVX512-BF16) "
                                        "(--dtype to choose)")
    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "1", "--device", "cpu",
                                 "--dtype", "float32"])
    assert r.exit_code == 0 and "dtype " not in r.stderr
    monkeypatch.setenv(train_dtype.ENV, "float16")                    # the caller's own default is not news
    r = CliRunner().invoke(app, ["train", str(ASSETS / "train_mlp.py"), "--steps", "1", "--device", "cpu"])
    assert r.exit_code == 0 and "dtype " not in r.stderr
