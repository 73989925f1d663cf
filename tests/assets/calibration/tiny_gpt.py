"""A nanoGPT-shaped language model with GPT-2's 50257-token head and everything else tiny (d=32, one block,
sequence 8, batch 2), with train_data() and loss_fn as a training script has them. Its fp16 training is fine.
A backward of the *sum* of the logits is not: each token's hidden gradient is then the sum of the head's 50257
rows (the same vector for every token), so the bias gradients grow with the token count. Largest FP32 parameter
gradient of the sum: 1.3e3 on 2 x 8 tokens, 8.7e4 on 8 x 128 (over fp16's 65504); of loss_fn: 0.17 and 0.012
(tests/test_calibrate_loss.py::test_the_sum_of_a_wide_head_is_what_overflowed shows the fp16 overflow)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, SEQ, BATCH, BLOCK = 50257, 32, 2, 8, 2, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(att)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(BLOCK, D)
        self.h = nn.ModuleList([Block()])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight          # weight tying, as GPT-2
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    torch.manual_seed(0)
    return GPT()


def example_inputs():
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)),)


def train_data(batch=BATCH, seq=SEQ):
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
