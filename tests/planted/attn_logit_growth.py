"""Attention-logit growth at a high learning rate: a two-layer decoder without qk-layernorm, trained in bf16 with
AdamW at lr 0.3 (warmup 30 steps) on a Markov chain of 32 tokens (4 successors each: a loss floor of ln 4). The
largest pre-softmax logit grows from ~2 past 100 within ~20 steps and towards 1e3-1e4, and the loss then breaks
away from its best value. The small-scale proxy of Wortsman et al. 2023 (arXiv 2309.14322: no qk-layernorm, high
LR; the max attention logit grows, quality degrades from ~1e3, runs past ~1e4 diverge) and Dehghani et al. 2023
(ViT-22B, attention-logit divergence, fixed by qk-layernorm). ``build_qknorm_model`` is the same model with
qk-layernorm: its logits stay bounded at the same learning rate.

    ampaudit train tests/planted/attn_logit_growth.py --steps 60 --device cpu --dtype bfloat16 --trace run.jsonl
    ampaudit report run.jsonl          # warns on blocks.*.attn before the loss breaks
    ampaudit train tests/planted/attn_logit_growth.py --entry build_qknorm_model ...   # stays quiet

The fault is in training dynamics, not in one forward ("phase": "training"): one calibrated pass sees a healthy
model at initialization; the trace of a run names it, and so does check given training steps (a copy trained in
memory with the same meters):

    ampaudit check tests/planted/attn_logit_growth.py --calibrate --device cpu --dtype bfloat16 --train-steps 34
"""
import torch, torch.nn as nn, torch.nn.functional as F

# Both attention modules grow; blocks.1.attn crosses the warning line first (step 17), blocks.0.attn later (step 33).
EXPECT = {"culprit": "blocks.1.attn", "culprits": ["blocks.0.attn", "blocks.1.attn"], "families": ["precursor"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "training", "signal": "attn_logit"}

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 32, 64, 4, 2, 32, 32
LR, WARMUP = 0.3, 30


class Attention(nn.Module):
    def __init__(self, qk_norm=False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False); self.proj = nn.Linear(D, D, bias=False)
        self.q_norm = nn.LayerNorm(D // HEADS) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(D // HEADS) if qk_norm else nn.Identity()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self, qk_norm=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(D); self.attn = Attention(qk_norm); self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, qk_norm=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D); self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(qk_norm) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D); self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model():
    torch.manual_seed(0); return Decoder()


def build_qknorm_model():
    torch.manual_seed(0); return Decoder(qk_norm=True)


def example_inputs():
    return (next(iter(train_data(1)))[0],)


def train_data(batches=1000):
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    for _ in range(batches):
        seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            seq[:, i + 1] = successors[seq[:, i], torch.randint(0, 4, (BATCH,), generator=g)]
        yield seq[:, :-1], seq[:, 1:]


def loss_fn(output, target):
    return F.cross_entropy(output.float().reshape(-1, VOCAB), target.reshape(-1))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
