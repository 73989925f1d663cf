"""A gated linear recurrence (a minGRU / gated-delta-style token mixer): ``h_t = z_t * h_{t-1} + (1 - z_t) * n_t``
with ``z = sigmoid(gate(x))``, the retain gates initialised towards 1 (chrono initialisation, Tallec & Ollivier 2018:
bias log(U(1, 999)), memories of up to ~1000 tokens; the gate's input weights small). The gate and candidate
Linears are healthy; the cell's own arithmetic between them is not: under autocast the gate logits are bf16, so
``sigmoid`` is bf16 too, and below 1 bf16 steps by 2^-8 = 0.0039: every gate above 0.998 is 1.0 (``1 - z`` = 0,
the channel never takes input), the others' ``1 - z`` is off by up to 0.002 (30% of a gate of 0.994), and the state, rounded to bf16 on every
token, compounds it over 256 tokens. The cell's own output is 42% off in relative L2, the model's 26%, finite; the
Linears around it lose ~1 unit roundoff (measured: each module's output under autocast against FP32 on
``example_inputs()``, the culprit on FP32's inputs). Published: sgl-project/sglang#38975 (GDN decode rounds sigmoid(beta) through bf16: "recurrent-state drift
accumulates with context length"; fixed by keeping it fp32, as vllm-project/vllm#53877 did), meta-pytorch/
attention-gym#348 ("recurrence math and state are FP32 for FP16/BF16 inputs"). ``build_fixed_model`` is that fix:
the gates and the recurrence in float32, the Linears under autocast (0.7% off)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "mixer", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}

D, T, BATCH, T_MAX, GATE_GAIN = 64, 256, 8, 1000, 0.1


class GatedRecurrence(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.gate = nn.Linear(D, D); self.cand = nn.Linear(D, D)
        with torch.no_grad():       # chrono initialisation: memories of 1 to T_MAX tokens across the channels
            self.gate.bias.copy_(torch.empty(D).uniform_(1, T_MAX - 1).log())
            self.gate.weight.mul_(GATE_GAIN)

    def forward(self, x):                           # x: (batch, time, D)
        logits, cand = self.gate(x), self.cand(x)
        if self.fp32:
            with torch.autocast(x.device.type, enabled=False):
                return self._scan(logits.float(), cand.float()).to(logits.dtype)
        return self._scan(logits, cand)

    @staticmethod
    def _scan(logits, cand):
        z, n = torch.sigmoid(logits), torch.tanh(cand)  # bf16 under autocast: z near 1 in steps of 2^-8
        h, out = torch.zeros_like(n[:, 0]), []
        for t in range(n.shape[1]):
            h = z[:, t] * h + (1 - z[:, t]) * n[:, t]
            out.append(h)
        return torch.stack(out, 1)


class Net(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.embed = nn.Linear(16, D); self.mixer = GatedRecurrence(fp32); self.head = nn.Linear(D, 16, bias=False)

    def forward(self, x):
        return self.head(self.mixer(self.embed(x)))


def build_model():
    torch.manual_seed(0); return Net()

def build_fixed_model():
    torch.manual_seed(0); return Net(fp32=True)

def example_inputs():
    torch.manual_seed(1); return (torch.randn(BATCH, T, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(BATCH, T, 16, generator=g); yield x, x.cumsum(1) / T

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
