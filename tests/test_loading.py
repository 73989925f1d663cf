"""The model-file protocol: what loads, and the one-line error for each way it can fail."""
from __future__ import annotations


import pytest
import torch

from ampaudit.errors import InputError, ModelLoadError
from ampaudit.loading import load_target, parse_input_spec

from conftest import ASSETS, PLANTED

BAD = ASSETS / "bad"


def test_build_model_and_example_inputs(tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
                 "def example_inputs():\n    return torch.randn(3, 4)\n"
                 "def train_data():\n    yield torch.randn(3, 4), torch.randn(3, 2)\n")
    loaded = load_target(str(f))
    assert isinstance(loaded.model, torch.nn.Linear)
    assert loaded.args[0].shape == (3, 4) and loaded.kwargs == {}
    assert loaded.hook("train_data") is not None and loaded.hook("loss_fn") is None


def test_module_level_model_and_dict_inputs(tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, x, y=None):\n        return x\n"
                 "model = M()\ndef example_inputs():\n    return {'x': torch.ones(2)}\n")
    loaded = load_target(str(f))
    assert loaded.kwargs.keys() == {"x"} and loaded.args == ()


def test_entry_names_a_class(tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch\nclass Tiny(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.fc = torch.nn.Linear(4, 4)\n    def forward(self, x):\n        return self.fc(x)\n")
    loaded = load_target(str(f), entry="Tiny", inputs=["2x4"])
    assert type(loaded.model).__name__ == "Tiny" and loaded.args[0].shape == (2, 4)


def test_package_factory(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    loaded = load_target("pkgdemo:make_model")
    assert isinstance(loaded.model, torch.nn.Sequential) and loaded.args[0].shape == (8, 64)


@pytest.mark.parametrize("name, error, words", [
    ("missing.py", ModelLoadError, ["not found"]),
    ("syntax_error.py", ModelLoadError, ["syntax error", "line 2"]),
    ("no_model.py", ModelLoadError, ["no model found", "build_model", "--entry"]),
    ("factory_raises.py", ModelLoadError, ["build_model() raised ValueError", "hidden_size", "factory_raises.py:5"]),
    ("inputs_mismatch.py", InputError, ["do not fit", "forward(x, mask)"]),
    ("import_raises.py", ModelLoadError, ["RuntimeError", "import_raises.py:2"]),
    ("no_inputs.py", InputError, ["no example inputs", "--input"]),
    ("returns_int.py", ModelLoadError, ["not an nn.Module"]),
])
def test_bad_model_files(name, error, words):
    with pytest.raises(error) as info:
        load_target(str(BAD / name))
    text = info.value.one_line()
    assert "\n" not in text and info.value.hint
    for w in words:
        assert w in text, text


def test_unknown_entry_lists_candidates():
    with pytest.raises(ModelLoadError) as info:
        load_target(str(BAD / "inputs_mismatch.py"), entry="nope")
    assert "no 'nope'" in info.value.one_line() and "Net" in info.value.one_line()


def test_unimportable_package():
    with pytest.raises(ModelLoadError, match="cannot import"):
        load_target("no_such_pkg_xyz:factory")


@pytest.mark.parametrize("spec, shape, dtype", [
    ("8x3x32x32", (8, 3, 32, 32), torch.float32),
    ("4x128:int64", (4, 128), torch.int64),
    ("2,5:bf16", (2, 5), torch.bfloat16),
])
def test_parse_input_spec(spec, shape, dtype):
    t = parse_input_spec(spec)
    assert t.shape == shape and t.dtype == dtype


@pytest.mark.parametrize("spec", ["8xx3", "abc", "4x4:float99"])
def test_parse_input_spec_rejects(spec):
    with pytest.raises(InputError):
        parse_input_spec(spec)


@pytest.mark.skipif(not PLANTED.is_dir(), reason="planted models absent")
def test_loads_every_planted_model():
    for path in sorted(PLANTED.glob("*.py")):
        loaded = load_target(str(path))
        assert isinstance(loaded.model, torch.nn.Module), path.name


@pytest.mark.parametrize("body, words", [
    ('"hello"', "returned str; expected a tuple of tensors, a tensor, or a dict of keyword arguments"),
    ("None", "returned None; expected a tuple of tensors"),
    ("42", "returned int; expected"),
    ('("a", "b")', "holds no tensors (only str)"),
    ("()", "holds no tensors (it is empty)"),
])
def test_example_inputs_must_hold_tensors(tmp_path, body, words):
    f = tmp_path / "net.py"
    f.write_text(f"import torch\ndef build_model():\n    return torch.nn.Linear(4, 4)\n"
                 f"def example_inputs():\n    return {body}\n")
    with pytest.raises(InputError) as info:
        load_target(str(f))
    assert words in info.value.one_line() and "--input" in info.value.one_line()


def test_example_inputs_may_mix_tensors_and_flags(tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, x, mask=None, train=False):\n"
                 "        return x\ndef build_model():\n    return M()\n"
                 "def example_inputs():\n    return (torch.randn(2, 4), None), {'train': True}\n")
    loaded = load_target(str(f))
    assert loaded.args[1] is None and loaded.kwargs == {"train": True}


def test_input_spec_too_large_is_an_input_error():
    with pytest.raises(InputError) as info:
        parse_input_spec("99999999999x99999999999")
    assert "cannot make a tensor" in info.value.one_line() and "smaller shape" in info.value.one_line()
