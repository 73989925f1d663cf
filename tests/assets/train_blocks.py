"""A residual-block model for the FSDP tests: an nn.ModuleList of identical blocks (FSDP's default units), no
dropout or BatchNorm, so runs on different numbers of ranks can be compared, and a seeded finite data stream.
``mixed_dtype_model`` and ``bf16_model`` are the two models the precision preflight must refuse."""
import torch
import torch.nn as nn

BATCHES = 64


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BlockNet(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return BlockNet()


def mixed_dtype_model():
    """One block holds a bfloat16 Linear beside fp32 ones: its FSDP group would mix dtypes."""
    model = build_model()
    model.blocks[1].down.to(torch.bfloat16)
    return model


def bf16_model():
    """Cast to bfloat16 before sharding: FSDP2 would train without fp32 master weights."""
    return build_model().to(torch.bfloat16)


def train_data(batch: int = 8, batches: int = BATCHES):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 1, generator=g)
    for _ in range(batches):
        x = torch.randn(batch, 16, generator=g)
        yield x, torch.sin(x @ w)


def loss_fn(output, target):
    return ((output.float() - target) ** 2).mean()


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
