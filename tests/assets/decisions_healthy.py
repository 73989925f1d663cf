"""A model whose decisions precision does not flip: a top-2 MoE router computed in fp32 (Switch Transformer's
selective precision) on fp32 inputs, a causal mask from integer positions (exact in every dtype), a padding mask
compared on an fp32 input, and a final argmax that is only returned (the predictions beside the logits)."""
import torch, torch.nn as nn, torch.nn.functional as F

D, E, K, T = 32, 8, 2, 16


class Router(nn.Module):
    def __init__(self):
        super().__init__(); self.gate = nn.Linear(D, E, bias=False)
    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            logits = self.gate(x.float())                       # fp32 router
        weights, experts = logits.softmax(-1).topk(K, -1)
        return weights, experts


class Block(nn.Module):
    def __init__(self):
        super().__init__(); self.router = Router(); self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))
        self.qkv = nn.Linear(D, 3 * D)
    def forward(self, x):
        b, t, d = x.shape
        weights, experts = self.router(x)
        moe = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (weights * (experts == e)).sum(-1, keepdim=True)
            moe = moe + gate.to(x.dtype) * expert(x)
        pos = torch.arange(t, device=x.device)
        causal = pos[None, :] > pos[:, None]                     # integer positions: never flips
        keep = (x.abs().sum(-1) > 0)                             # fp32 input: padding rows are exact zeros
        q, k, v = self.qkv(moe).chunk(3, -1)
        att = (q @ k.transpose(-2, -1)) / d ** 0.5
        att = att.masked_fill(causal | ~keep[:, None, :], torch.finfo(att.dtype).min)
        return moe + att.softmax(-1) @ v


class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.block = Block(); self.head = nn.Linear(D, 10)
    def forward(self, x):
        logits = self.head(self.block(x))
        return logits, logits.argmax(-1)                         # predictions: returned, not used


def build_model():
    torch.manual_seed(0); return Net()


def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, T, D),)


def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(4, T, D, generator=g); yield x, x[..., :10]


def loss_fn(output, target):
    return F.mse_loss(output[0].float(), target)
