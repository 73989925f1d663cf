"""A small character-level GPT trained on Shakespeare's sonnets (samples/data/sonnets.txt).

What it shows: a decoder-only transformer written the way many real models are written: token plus learned
position embeddings, pre-LayerNorm blocks of hand-written causal self-attention, a GELU MLP and an untied
language-model head. The causal mask is additive and built from a large negative constant (-1e9) after the
0/1 mask has been cast to the attention scores' dtype, as several Hugging Face models do.

Run it:  ``ampaudit check samples/char_transformer.py --device cuda --dtype float16``
         ``ampaudit train samples/char_transformer.py --steps 200 --trace run.jsonl``

Findings it should produce (CUDA fp16 policy):
- ``alignment``: the vocabulary comes from the text (58 characters), so ``tok_emb`` and the ``head`` GEMM
  (out=58) miss the Tensor Core grid of 8; pad the vocabulary to 64.
- ``constant``: ``blocks.*.attn`` multiplies the fp16 mask by -1e9, which fp16 cannot hold (max 65504): the
  masked scores become -inf. Causal rows always keep the diagonal, so this stays silent (no NaN) here, but a
  fully masked row (padding) would turn into NaN.
- ``sensitive-op``: softmax runs in fp16 under the CPU policy (CUDA autocast keeps it fp32). The LayerNorms
  stay fp32 even on CPU: the residual stream starts from the embeddings, which autocast leaves in fp32.
It trains in FP32, bf16 and fp16 (with a loss scaler) without non-finite values.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {"culprit": None, "families": ["alignment", "constant"],
          "misaligned": {"tok_emb": 58, "head": 58}}

TEXT_PATH = Path(__file__).resolve().parent / "data" / "sonnets.txt"
BLOCK = 64          # context length in characters
BATCH = 16
D_MODEL = 64
N_HEAD = 4
N_LAYER = 2
# Many checkpoints build additive masks from -1e9 or finfo(float32).min; both overflow fp16.
MASK_VALUE = -1e9


@functools.lru_cache(maxsize=1)
def load_text() -> str:
    """The training text (about 31 KB of the sonnets)."""
    return TEXT_PATH.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Sorted distinct characters of the text; its length is the model's vocabulary size."""
    return tuple(sorted(set(load_text())))


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 ids (every character must be in the vocabulary)."""
    index = {ch: i for i, ch in enumerate(vocabulary())}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    """int ids -> text."""
    chars = vocabulary()
    return "".join(chars[i] for i in ids.tolist())


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with an additive causal mask, written out by hand."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        # Built from the traced length (not sliced from a buffer) so torch.fx can trace it. The 0/1 mask is
        # cast to the scores' dtype first, then scaled: in fp16 the -1e9 becomes -inf.
        causal = x.new_ones(seq, seq).tril()
        bias = (1.0 - causal.to(scores.dtype)) * MASK_VALUE
        weights = F.softmax(scores + bias, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """ids (batch, seq<=block) int64 -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int, d_model: int = D_MODEL, n_head: int = N_HEAD,
                 n_layer: int = N_LAYER, block: int = BLOCK) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CharTransformer(len(vocabulary()))


def example_inputs() -> tuple[torch.Tensor]:
    """One batch of windows from the text, (BATCH, BLOCK) int64."""
    return (next(iter(train_data(batches=1)))[0],)


def train_data(batches: int = 2000, seed: int = 2) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (ids, next-character targets), both (BATCH, BLOCK) int64, from random windows of the text."""
    data = encode(load_text())
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(BLOCK)
    for _ in range(batches):
        starts = torch.randint(0, len(data) - BLOCK - 1, (BATCH, 1), generator=g)
        window = starts + offsets
        yield data[window], data[window + 1]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Cross entropy in fp32: the log-softmax over the vocabulary is the reduction fp16 handles worst.
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


@torch.no_grad()
def sample(model: nn.Module, prompt: str = "Shall I compare thee", length: int = 80) -> str:
    """Greedy continuation of ``prompt``; shows what training has learnt."""
    model.eval()
    ids = encode(prompt).unsqueeze(0)
    for _ in range(length):
        logits = model(ids[:, -BLOCK:])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return decode(ids[0])


if __name__ == "__main__":
    net = build_model()
    opt = make_optimizer(net.parameters())
    for step, (x, y) in enumerate(train_data(batches=300)):
        loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    print(sample(net))
