"""A tiny language model whose head shares the embedding's weight, with a vocabulary of 50 and width 30:
--pad must grow the shared weight once, keep it shared, and slice the logits back to 50."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class TiedLM(nn.Module):
    def __init__(self, vocab=50, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, 30)
        self.proj = nn.Linear(30, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.proj(F.relu(self.fc(h)))
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return TiedLM()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randint(0, 50, (4, 6)),)
