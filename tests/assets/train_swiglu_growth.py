"""A SwiGLU block whose down projection's input grows an outlier during training (planted): fine in float8 at step
0, not later. Fishman et al. 2024, "Scaling FP8 training to trillion-token LLMs", arXiv:2409.12517: FP8 training
diverged after ~200B tokens because SwiGLU amplifies outliers: once a hidden unit's gate and up weights align,
silu(w1.x) * (w2.x) grows with the square of |x| along them, and one unit of the down projection's input dwarfs
the rest. Here the alignment is planted (unit 0's gate and up rows both read input feature 0) and the growth is
compressed into the run: feature 0 of the input ramps up GROWTH-fold over the run's RAMP_STEPS steps (as the
residual stream's outlier features grow in long runs), so hidden unit 0 grows about GROWTH^2-fold. With one scale
per tensor (or per token row: the unit is in every row), the rest of the down projection's input then flushes
to 0 in e4m3; bf16 keeps it. The target is a fixed random teacher on the un-ramped input, which needs the bulk.

Model-file protocol: build_model(), train_data(), loss_fn(); PLAN is the plan a step-0 measurement would give
(every Linear in float8 tensorwise, which they survive at step 0).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HIDDEN, TOKENS = 32, 64, 32
GROWTH, RAMP_STEPS, STEPS = 400.0, 60, 160
ALIGN = 2.0


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.down(F.silu(self.gate(x)) * self.up(x)))


def _planted(model: SwiGLU) -> SwiGLU:
    """Feature 0 is read by unit 0 alone, through aligned gate and up rows, and unit 0 is read by nothing (a
    massive activation acting as a bias, as in LLMs, whose readout weights are ~0); training keeps it so."""
    with torch.no_grad():
        for w in (model.gate.weight, model.up.weight):
            w[:, 0] = 0.0
            w[0] = 0.0
            w[0, 0] = ALIGN
        model.down.weight[:, 0] = 0.0
    keep = {model.gate.weight: (slice(None), 0), model.up.weight: (slice(None), 0), model.down.weight: (slice(None), 0)}
    for w, (rows, col) in keep.items():
        def fixed(grad, col=col, w=w):
            grad = grad.clone()
            grad[:, col] = 0.0
            if w is not model.down.weight:
                grad[0] = 0.0
            return grad
        w.register_hook(fixed)
    return model


def build_model(seed: int = 0) -> SwiGLU:
    torch.manual_seed(seed)
    return _planted(SwiGLU())


def _teacher(seed: int) -> SwiGLU:
    torch.manual_seed(1000 + seed)
    return SwiGLU()


def train_data(seed: int = 0, steps: int = STEPS, ramp_steps: int = RAMP_STEPS, growth: float = GROWTH):
    g = torch.Generator().manual_seed(seed)
    teacher = _teacher(seed)
    for step in range(steps):
        x = torch.randn(TOKENS, DIM, generator=g)
        x[:, 0] = x[:, 0].abs() + 0.5          # the outlier feature is positive, where silu(g) * u ~ g^2
        with torch.no_grad():
            clean = x.clone()
            clean[:, 0] = 0.0
            y = teacher(clean)
        x[:, 0] *= growth ** min(1.0, step / max(1, ramp_steps))
        yield x, y


def loss_fn(output, target):
    return F.mse_loss(output.float(), target)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)


def plan() -> dict:
    """Every Linear in float8 tensorwise (version 2): what a plan measured at step 0 chooses here."""
    shapes = {"gate": (DIM, HIDDEN), "up": (DIM, HIDDEN), "down": (HIDDEN, DIM), "head": (DIM, DIM)}
    return {"version": 2, "layers": [{"module": m, "choice": "float8_tensorwise",
                                      "shape": {"in_features": i, "out_features": o}} for m, (i, o) in shapes.items()]}
