"""A change detector in the FC-Siam-diff layout (Daudt et al. 2018, arXiv 1810.08462): one encoder applied to two
views, the composite's own forward takes the difference of the two encodings and a head classifies it. The views
differ by a little (sensor noise on a mostly unchanged scene), so the encodings agree to ~0.5% and their bf16 storage
(a relative 2^-9) leaves the difference mostly rounding noise: catastrophic cancellation, finite, while the encoder
and the head are ordinary GEMMs. Large similar intermediates subtracted in bf16: NVIDIA/TensorRT#4718."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "change", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}


class ChangeHead(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h))
        self.classify = nn.Linear(h, 2)

    def forward(self, before, after):
        diff = self.encoder(after) - self.encoder(before)      # two nearly equal bf16 encodings
        return self.classify(diff / 0.01)                      # rescaled to unit size (noise level of the views)


class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.change = ChangeHead()

    def forward(self, before, after):
        return self.change(before, after)


def _views(g, n=16, d=32):
    scene = torch.randn(n, d, generator=g)
    return scene, scene + 0.01 * torch.randn(n, d, generator=g)


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    return _views(torch.Generator().manual_seed(1))

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        before, after = _views(g); yield (before, after), torch.randint(0, 2, (16,), generator=g)

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
