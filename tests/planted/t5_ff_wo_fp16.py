"""T5 feed-forward block whose down projection `wo` overflows fp16: the residual stream carries a few massive channels,
and `wo` writes up to ~8e4 into them, past fp16's 65504; the stored product is inf, the residual add keeps it, and
the next T5 RMSNorm (upcast to fp32, as T5's is) computes rsqrt(inf) = 0 and inf * 0 = NaN.
huggingface/transformers#9295 (T5 fp16: inf in the FF layer before `wo`; the clamp_value workaround) and
openvinotoolkit/openvino#37084 (flan-t5: the first inf at `DenseReluDense.wo`, 5 elements past 65504).
``build_fixed_model`` is transformers' own fix, `wo` kept in float32 (`_keep_in_fp32_modules = ["wo"]` in
modeling_t5): no overflow, nothing to report."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "ff.wo", "families": ["nonfinite", "range"], "target": {"device": "cpu", "dtype": "float16"},
          "phase": "forward"}

D, FF, MASSIVE = 64, 256, (3, 17)       # two residual channels with massive activations (Sun et al. 2024)


class T5RMSNorm(nn.Module):
    """modeling_t5's T5LayerNorm: the variance in float32."""
    def __init__(self, d, eps=1e-6):
        super().__init__(); self.weight = nn.Parameter(torch.ones(d)); self.eps = eps
    def forward(self, h):
        var = h.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (h.float() * torch.rsqrt(var + self.eps))


class T5LayerFF(nn.Module):
    def __init__(self, fp32_wo=False):
        super().__init__()
        self.norm = T5RMSNorm(D); self.wi = nn.Linear(D, FF, bias=False); self.wo = nn.Linear(FF, D, bias=False)
        self.fp32_wo = fp32_wo
    def forward(self, h):
        u = F.relu(self.wi(self.norm(h)))
        if self.fp32_wo:                                    # the fix: the down projection runs in float32
            with torch.autocast("cpu", enabled=False):
                return h.float() + self.wo(u.float())
        return h + self.wo(u)


class Net(nn.Module):
    def __init__(self, fp32_wo=False):
        super().__init__()
        self.embed = nn.Linear(16, D); self.ff = T5LayerFF(fp32_wo); self.final_norm = T5RMSNorm(D)
        self.head = nn.Linear(D, 4)
        with torch.no_grad():       # trained T5 FF weights: wi ~4x init, wo writes the massive channels coherently
            self.ff.wi.weight.mul_(4.0)
            self.ff.wo.weight[list(MASSIVE)] = 300.0 + 30.0 * torch.randn(len(MASSIVE), FF)
    def forward(self, x):
        return self.head(self.final_norm(self.ff(self.embed(x))))


def build_model():
    torch.manual_seed(0); return Net()

def build_fixed_model():
    torch.manual_seed(0); return Net(fp32_wo=True)

def example_inputs():
    torch.manual_seed(1); return (torch.randn(2, 24, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(2, 24, 16, generator=g); yield x, (x.mean(-1) > 0).long()

def loss_fn(output, target):
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten())
