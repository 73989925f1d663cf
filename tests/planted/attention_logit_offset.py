"""Self-attention whose keys share a large component: the key projection's bias is large (60 per channel), so each
query's scores sit near one large value, q . b_k (~140 in size), with a spread of ~1. Softmax ignores that shift (the gradient of
b_k is exactly zero, so training never pulls it back; Swin-V2's attention leaves the key bias out for this reason),
FP32 keeps the spread, but the attention module's own q @ k^T (lowered by autocast) stores the scores in bf16,
whose step at 128-256 is 1: the spread is rounded away and the attention weights are off by tens of percent,
finite. Its child projections are ordinary GEMMs. Large attention logits losing precision, and qk-layernorm
(normalising q and k before the scores) as the fix: Wortsman et al. 2023, arXiv 2309.14322; Dehghani et al. 2023,
arXiv 2302.05442."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "attn", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}
D, HEADS, T = 64, 4, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        with torch.no_grad():
            self.q.weight.mul_(8.0)                               # the queries of a trained layer
            self.k.bias.copy_(60.0 * torch.randn(D).sign())       # the shared component of every key

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, HEADS, d // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (d // HEADS) ** -0.5
        return self.proj((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(16, D, bias=False), Attention(), nn.Linear(D, 8, bias=False)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)))


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(4, T, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(4, T, 16, generator=g); yield x, x[..., :8]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
