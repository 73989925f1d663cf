"""nanoGPT-style, one block, with an exp gate whose output passes float16's 65504 (check --calibrate: range
overflow in ``gate``) and a Linear head of 65 outputs (AMP101): torch.fx cannot trace it (``B, T, C = x.size()``,
``self.bias[:, :, :T, :T]``), so check audits it through torch.export and fix works on its module tree."""
import math

import torch
import torch.nn.functional as F
from torch import nn

BLOCK, VOCAB, EMBD, HEADS = 8, 65, 32, 2


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class ExpGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(EMBD, EMBD)
        nn.init.constant_(self.proj.bias, 12.0)     # exp(12) = 162755: beyond float16's 65504

    def forward(self, x):
        return x * torch.exp(self.proj(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.ln = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.gate = ExpGate()
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.attn(self.ln(x))
        return self.lm_head(self.gate(x))


def build_model():
    torch.manual_seed(0)
    return GPT()


def example_inputs():
    return (torch.randint(0, VOCAB, (2, BLOCK)),)
