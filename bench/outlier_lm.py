"""The sample's character-level GPT with "massive activations" in its MLPs: a model float8 on every Linear hurts.

    from outlier_lm import build_outlier_lm       # (run from bench/, or put bench/ on sys.path)
    model = build_outlier_lm(seed=0)              # samples/char_transformer.py's model, vocabulary padded to 64
    logits = model(ids)                           # (batch, seq, 64)

LLMs carry a few activations up to about 1e5 times the median, in fixed feature dims of the start token, nearly
constant across inputs and acting as fixed biases; they appear abruptly at one early layer (Sun et al. 2024,
"Massive Activations in Large Language Models", arXiv:2402.17762). Outliers in the input of the MLP's output
projection are what made FP8 training of LLMs diverge in long runs (Fishman et al. 2024, "Scaling FP8 training to
trillion-token LLMs", arXiv:2409.12517). Here the MLP of each block in ``OUTLIER_BLOCKS`` adds ``MASSIVE`` to
hidden unit ``MASSIVE_UNIT`` of the first position of every sequence, right before ``mlp.proj``. That unit's column
of ``proj.weight`` is scaled to ``1 / MASSIVE`` of the others and its gradient is zeroed, so the outlier adds an
ordinary-sized, fixed bias to position 0, as a fitted model's readout of a massive activation does (a learnable
weight on a 1e5 input would move that output by lr x 1e5 per Adam step). In FP32 or bf16 this is an ordinary GPT;
what changes is float8 with one scale per tensor (torchao's tensorwise recipe): the outlier sets ``proj``'s input
scale, and most other hidden units flush to 0 or land in e4m3's subnormals.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "char_transformer.py"
VOCAB = 64                  # the sonnets' 58 characters, padded so every Linear is a multiple of 16
MASSIVE = 1e5
MASSIVE_UNIT = 7
OUTLIER_BLOCKS = (0, 1)


def _sample():
    spec = importlib.util.spec_from_file_location("_outlier_lm_char_transformer", SAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ct = _sample()


class OutlierMLP(ct.MLP):
    """The sample's GELU MLP, plus a massive activation at position 0 of one hidden unit."""

    def __init__(self, d_model: int, massive: float = MASSIVE, unit: int = MASSIVE_UNIT) -> None:
        super().__init__(d_model)
        bump = torch.zeros(4 * d_model)
        bump[unit] = massive
        self.register_buffer("bump", bump)
        self.unit = unit
        with torch.no_grad():
            self.proj.weight[:, unit] /= massive
        mask = torch.ones_like(self.proj.weight)
        mask[:, unit] = 0.0
        # The bias-like readout stays fixed: its gradient is zeroed wherever the weight is used (Float8Linear
        # keeps the same Parameter, so the hook survives torchao's conversion).
        self.proj.weight.register_hook(lambda grad: grad * mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc(x))
        first = hidden[:, :1] + self.bump.to(hidden.dtype)
        return self.proj(torch.cat([first, hidden[:, 1:]], dim=1))


def build_outlier_lm(seed: int = 0, massive: float = MASSIVE, blocks: tuple[int, ...] = OUTLIER_BLOCKS) -> nn.Module:
    """The sample's CharTransformer (seeded), vocabulary 64, the MLPs of ``blocks`` :class:`OutlierMLP`."""
    torch.manual_seed(seed)
    model = ct.CharTransformer(VOCAB)
    for i in blocks:
        model.blocks[i].mlp = OutlierMLP(ct.D_MODEL, massive)
    return model
