"""An MLP whose activation is written in its own forward, between its two Linear children, as SiLU's negative branch
x * (1 - sigmoid(-x)): in bf16 sigmoid(-x) rounds to 1 for x below about -5.5, so 1 - sigmoid(-x) is 0 or a few
ulps of 1, and negative activations are zeroed or off by tens of percent. The module's own error lands at several
percent in bf16 (under the 12.5% line of 32 unit roundoffs) while every GEMM of the model sits near 0.3%: an outlier
against the model's own errors. Reported and fixed with z = exp(-|x|), z / (1 + z): skyzh/tiny-llm#164."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "mlp", "families": ["divergence"], "verdict": "relative",
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}


class MLP(nn.Module):
    def __init__(self, d=32, h=128):
        super().__init__(); self.fc1 = nn.Linear(d, h); self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        a = self.fc1(x)
        return self.fc2(a * (1 - torch.sigmoid(-a)))     # SiLU as x * sigmoid(x) = x * (1 - sigmoid(-x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32); self.mlp = MLP(); self.out = nn.Linear(32, 32); self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.mlp.fc1.bias.fill_(-5.0)     # a sparse layer: most pre-activations sit in the negative tail

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.relu(self.out(h + self.mlp(h))))


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(32, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(32, 16, generator=g); yield x, x[:, :4]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
