"""Every Python snippet of README.md runs as written (the protocol, the API, keep_fp32, the Trainer, the watch loop,
the pytest helpers), with the names the README says are the reader's own taken from a small model here. A snippet
preceded by ``<!-- snippet: needs ... -->`` (16-bit mixed precision on CUDA) is compiled, not run."""
from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"(<!-- snippet: (?P<skip>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = nn.Linear(64, 64)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class MyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _snippets() -> list[tuple[str, str | None]]:
    return [(m["code"], m["skip"]) for m in _BLOCK.finditer(README.read_text())]


def _reader_names() -> dict:
    """What the README's snippets take as the reader's own."""
    from typing import Iterable

    import ampaudit

    torch.manual_seed(0)
    model = MyNet()
    data = [(torch.randn(8, 64), torch.randn(8, 16)) for _ in range(3)]
    return {"torch": torch, "ampaudit": ampaudit, "Iterable": Iterable, "MyNet": MyNet, "model": model,
            "x": data[0][0], "loss_fn": nn.functional.mse_loss, "train_data": lambda: iter(data), "loader": data,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "scaler": torch.amp.GradScaler("cpu")}


# The README states a real run's length; here two steps show the call works.
_SHORTER = {"steps=1000": "steps=2"}


def test_readme_has_the_snippets_this_test_expects():
    codes = [c for c, _ in _snippets()]
    assert len(codes) >= 9
    assert any("ampaudit.watch(" in c for c in codes) and any("keep_fp32(" in c for c in codes)


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_readme_snippet_runs(index, tmp_path, monkeypatch):
    code, skip = _snippets()[index]
    compile(code, f"README.md snippet {index}", "exec")          # every snippet is valid Python
    if skip:
        pytest.skip(f"README marks it: {skip}")
    monkeypatch.chdir(tmp_path)                     # snippets write run.jsonl and the like
    for long, short in _SHORTER.items():
        code = code.replace(long, short)
    names = _reader_names()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # torch.autocast("cuda") on a CPU-only machine says it is off
        exec(compile(code, f"README.md snippet {index}", "exec"), names)
        for name, fn in list(names.items()):        # the pytest snippet defines tests: run them
            if name.startswith("test_") and callable(fn):
                from ampaudit.pytest_plugin import AmpAudit

                params = inspect.signature(fn).parameters
                fn(**({"amp_audit": AmpAudit({})} if "amp_audit" in params else {}))
