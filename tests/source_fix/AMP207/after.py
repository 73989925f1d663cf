"""Graph readout by segment sums, `zeros(G, d).index_add_(0, batch, h)` (torch_geometric's global_add_pool pattern):
under autocast the node features h come out of a Linear in the low dtype while the zeros are fp32, and index_add_
is on no autocast list, CUDA's or CPU's, so its kernel sees Float and BFloat16 and raises on the first batch. The
model is fine in FP32. The same failure as NVIDIA/apex#455 (index_add broken under O1 and O2)."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP207", "device": "cpu", "dtype": "bfloat16", "calibrate": False, "unsafe": False}

EXPECT = {"culprit": "pool", "families": ["sensitive-op", "nonfinite"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}
GRAPHS = 4

class SegmentSum(nn.Module):
    def forward(self, h, batch):
        return torch.zeros(GRAPHS, h.shape[-1], device=h.device).index_add_(0, batch, h.float())

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32); self.pool = SegmentSum(); self.head = nn.Linear(32, 2)
    def forward(self, x, batch):
        return self.head(self.pool(F.relu(self.embed(x)), batch))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(64, 8), torch.arange(64) % GRAPHS)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        yield (torch.randn(64, 8, generator=g), torch.arange(64) % GRAPHS), torch.randn(GRAPHS, 2, generator=g)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
