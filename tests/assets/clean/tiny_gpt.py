"""A clean tiny GPT (nanoGPT's layout: pre-norm blocks, causal self-attention written out with the dtype's own
min as the mask, GELU MLP, tied head): under bf16 autocast every module's own error is ordinary rounding."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": None, "families": [], "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}
VOCAB, D, HEADS, T = 96, 64, 4, 32


class Attention(nn.Module):
    def __init__(self):
        super().__init__(); self.qkv = nn.Linear(D, 3 * D); self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // HEADS) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        return self.proj((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(D), nn.LayerNorm(D), Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()


def build_model():
    torch.manual_seed(0); return TinyGPT()

def example_inputs():
    torch.manual_seed(1); return (torch.randint(0, VOCAB, (4, T)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        ids = torch.randint(0, VOCAB, (4, T + 1), generator=g); yield ids[:, :-1], ids[:, 1:]

def loss_fn(output, target):
    return F.cross_entropy(output.float().reshape(-1, VOCAB), target.reshape(-1))
