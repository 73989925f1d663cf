"""An untrained vector-quantised decoder (transformers' wavtokenizer at init): the codebook is all zeros, so every
code decodes to the same vector, the conv after it outputs its bias, constant over time, and the GroupNorms
normalise that constant signal. Their output is rounding residue times 1/sqrt(eps), in FP32 as in fp16: an own
error of ~100% against FP32 is one noise against another, not the dtype's doing. Neither path names them."""
import torch
import torch.nn.functional as F
from torch import nn


class ZeroCodebookDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.codebook = nn.Embedding(16, 32)
        nn.init.zeros_(self.codebook.weight)
        self.codebook.weight.requires_grad_(False)       # a codebook EMA-updated outside the optimizer
        self.embed = nn.Conv1d(32, 32, 7, padding=3)
        self.norm = nn.GroupNorm(32, 32, eps=1e-6)
        self.conv = nn.Conv1d(32, 32, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, 32, eps=1e-6)
        self.head = nn.Linear(32, 8)

    def forward(self, codes):
        h = self.embed(self.codebook(codes).transpose(1, 2))
        h = self.norm2(self.conv(F.silu(self.norm(h))))
        return self.head(h.transpose(1, 2))


def build_model():
    torch.manual_seed(0)
    return ZeroCodebookDecoder()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randint(0, 16, (2, 40)),)


def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        yield torch.randint(0, 16, (2, 40), generator=g), torch.randn(2, 40, 8, generator=g)


def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
