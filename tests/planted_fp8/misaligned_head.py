"""A GPT-2-style byte-level language model: 256 byte tokens plus <|endoftext|>, a vocabulary of 257, odd for the same
"+1" that makes GPT-2's 50257 odd. torch._scaled_mm, the FP8 GEMM torchao's Float8Linear calls on the GPU, needs
both weight dims to be multiples of 16 ("Expected both dimensions of mat2 to be divisible by 16"), so lm_head
(64 -> 257) cannot train in float8 as it is; padded to 272 output features with zero rows (fix --pad) it computes
the same logits and can. Its numbers are fine: alignment is the only reason. pytorch/ao#571 ("Expected trailing
dimension of mat1 to be divisible by 16"), meta-pytorch/float8_experimental#264 (an output layer's vocab_size set
to 32 to avoid the "must be divisible by 16" error), huggingface/accelerate#1188 (FP8 conversion skips Linears
whose weights are not multiples of 16, "for instance the classifier head"); nanoGPT pads GPT-2's 50257 to 50304."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"keep_out": "lm_head", "reason": "alignment", "recipe": "tensorwise", "fp8_ok": ["mlp.fc1", "mlp.fc2"]}

VOCAB, DIM, SEQ = 257, 64, 32

class MLP(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(DIM, 4 * DIM); self.fc2 = nn.Linear(4 * DIM, DIM)
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM); self.ln = nn.LayerNorm(DIM); self.mlp = MLP()
        self.ln_f = nn.LayerNorm(DIM); self.lm_head = nn.Linear(DIM, VOCAB)
    def forward(self, ids):
        h = self.wte(ids)
        h = h + self.mlp(self.ln(h))
        return self.lm_head(self.ln_f(h))

def build_model():
    torch.manual_seed(0); return Net()

def _ids(g):
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)

def example_inputs():
    return (_ids(torch.Generator().manual_seed(1))[:, :-1],)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(8):
        ids = _ids(g); yield ids[:, :-1], ids[:, 1:]

def loss_fn(output, target):
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten())
