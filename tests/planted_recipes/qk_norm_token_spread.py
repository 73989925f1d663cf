"""A query projection under QK-norm reading a residual stream whose token norms span 2^-12..2^12 (massive-activation
tokens beside quiet ones). The norm after the projection divides each token's gradient by that token's own scale,
so token t brings input ~a_t and output gradient ~1/a_t: each token's term of the weight gradient (grad_output_t x
input_t) is ordinary-sized. Forward and grad_input reduce along features, one token at a time: float8 rowwise scales
each token row by itself and keeps them (~29 dB). The weight gradient reduces along the tokens: a scale per feature
column over all tokens (rowwise), per tensor (tensorwise) or per 32 tokens (MXFP8) is set by the loudest token, and
the quiet tokens' terms flush. torchao's rowwise_with_gw_hp (and TE's backward_override) keep that one GEMM in bf16.
Massive activations: Sun et al. 2024, arXiv:2402.17762 (https://arxiv.org/abs/2402.17762); QK-norm: Dehghani et
al. 2023 (ViT-22B), arXiv:2302.05442; torchao's recipe: torchao/float8/config.py, ROWWISE_WITH_GW_HP."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"layer": "q_proj", "recipes": "tensorwise,rowwise,rowwise_with_gw_hp", "choice": "float8_rowwise_with_gw_hp",
          "gemms": None, "fails": ["float8_tensorwise", "float8_rowwise"], "others": ["out"]}
# With MXFP8 the same layer keeps forward and grad_input in mxfp8 and runs the weight gradient in bf16.
EXPECT_MX = {"recipes": "mxfp8", "choice": "mxfp8",
             "gemms": {"output": "mxfp8", "grad_input": "mxfp8", "grad_weight": "bfloat16"}}

DIM, SEQ = 64, 64

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False); self.q_norm = nn.RMSNorm(DIM); self.out = nn.Linear(DIM, DIM)
    def forward(self, h):
        return self.out(self.q_norm(self.q_proj(h)))

def build_model():
    torch.manual_seed(0); return Net()

def _batch(g):
    scale = 2.0 ** (torch.rand(2, SEQ, 1, generator=g) * 24 - 12)      # token norms 2^-12..2^12
    return torch.randn(2, SEQ, DIM, generator=g) * scale

def example_inputs():
    return (_batch(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = _batch(g); yield x, torch.randn(2, SEQ, DIM, generator=g)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
