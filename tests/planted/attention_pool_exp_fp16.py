"""Attention pooling (multiple-instance learning, Ilse et al. 2018) with its softmax written out as exp(s) / sum(exp(s))
without subtracting the max: in fp16 exp overflows past s = 11.09, and the instance scores of a trained scorer reach
~13, so exp(s) is inf and inf / inf = NaN in pool. uTensor/uTensor#175 (exp() in softmax overflows: "this infinity
value bubbles through to my results which yields a nan") and intel/xFasterTransformer#326 ("need to firstly minus max
element to avoid NaN issues"). ``build_fixed_model`` subtracts the max first, the fix both reports make: nothing to
report."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "pool", "families": ["nonfinite", "sensitive-op"],
          "target": {"device": "cpu", "dtype": "float16"}, "phase": "forward"}


class AttentionPool(nn.Module):
    def __init__(self, d=64, stable=False):
        super().__init__(); self.score = nn.Linear(d, 1); self.stable = stable
    def forward(self, h):
        s = self.score(h)                                     # (bags, instances, 1)
        if self.stable:
            s = s - s.amax(1, keepdim=True)
        w = torch.exp(s)
        w = w / w.sum(1, keepdim=True)
        return (w * h).sum(1)


class Net(nn.Module):
    def __init__(self, stable=False):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(24, 64), nn.ReLU()); self.pool = AttentionPool(stable=stable)
        self.head = nn.Linear(64, 2)
        with torch.no_grad():   # a trained scorer: the key instances score ~10-13 against the rest's ~0-5
            self.pool.score.weight.mul_(14.0)
    def forward(self, x):
        return self.head(self.pool(self.enc(x)))


def build_model():
    torch.manual_seed(0); return Net()

def build_fixed_model():
    torch.manual_seed(0); return Net(stable=True)

def example_inputs():
    torch.manual_seed(1); return (torch.randn(8, 32, 24),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(8, 32, 24, generator=g); yield x, (x[:, :, 0].amax(1) > 2).long()

def loss_fn(output, target):
    return F.cross_entropy(output.float(), target)
