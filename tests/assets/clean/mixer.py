"""A clean MLP-Mixer (Tolstikhin et al. 2021: patch embedding, token-mixing and channel-mixing MLPs with LayerNorm and
residuals, mean-pooled head): under bf16 autocast every module's own error is ordinary rounding."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": None, "families": [], "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}
PATCHES, D = 16, 48


class MixerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.tokens = nn.Sequential(nn.Linear(PATCHES, 2 * PATCHES), nn.GELU(), nn.Linear(2 * PATCHES, PATCHES))
        self.channels = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, D, 4, 4)
        self.blocks = nn.Sequential(MixerBlock(), MixerBlock())
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


def build_model():
    torch.manual_seed(0); return Mixer()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(8, 3, 16, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        yield torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
