"""Fine-grained mixture of experts (128 experts, top-8 per token, as DeepSeek-V3 routes 8 of 256) whose router is a plain nn.Linear:
under autocast its logits come from a bf16 GEMM, and with 128 close logits per token the bf16 error (~0.4% of a
logit) is larger than the gap between the 8th and 9th expert for a few percent of the tokens, which then go to
another expert than in FP32. The softmax in fp32 (Mixtral's ``softmax(..., dtype=torch.float)``) comes too late:
the logits are rounded already. Routers are kept in fp32 for this: Switch Transformer's selective precision (Fedus
et al. 2021, arXiv 2101.03961), databricks/megablocks#91, vllm-project/vllm#14027 (DeepSeek V2/V3 router logits
moved from bf16 to fp32), vllm-project/vllm#58076 (bf16 router logits flip the experts of near-tied tokens)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "moe.router", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward",
          "decisions": {"op": "topk", "min_share": 0.02}}

D, H, E, K = 64, 32, 128, 8

class Router(nn.Module):
    def __init__(self):
        super().__init__(); self.gate = nn.Linear(D, E, bias=False)
    def forward(self, x):
        logits = self.gate(x)                                   # bf16 under autocast
        weights, experts = F.softmax(logits, -1, dtype=torch.float32).topk(K, -1)
        return weights / weights.sum(-1, keepdim=True), experts

class MoE(nn.Module):
    def __init__(self):
        super().__init__(); self.router = Router()
        self.w1 = nn.Parameter(torch.randn(E, D, H) / D ** 0.5); self.w2 = nn.Parameter(torch.randn(E, H, D) / H ** 0.5)
    def forward(self, x):
        weights, experts = self.router(x)                        # (T, K)
        gates = (F.one_hot(experts, E) * weights.unsqueeze(-1)).sum(1)   # (T, E): the routing, used
        h = F.gelu(torch.einsum("td,edh->teh", x, self.w1))     # every expert on every token: small and simple
        y = torch.einsum("teh,ehd->ted", h, self.w2)
        return (gates.unsqueeze(-1).to(y.dtype) * y).sum(1)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.moe = MoE(); self.head = nn.Linear(D, 8)
    def forward(self, x):
        return self.head(x + self.moe(x))

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(512, D),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(512, D, generator=g); yield x, x[:, :8]

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
