"""Flow-matching denoiser that casts its float timestep to the activations' dtype before the sinusoidal embedding (Wan
in DiffSynth-Studio: `timestep.to(dtype=self.torch_dtype)`): bf16's spacing in [512, 1024) is 4, so the sampler's
998.39 becomes 1000 and 987.17 becomes 988; the embedding's fast frequencies (sin(t) at 1 rad per unit) are off by
radians, and the adaLN scale and shift every block takes from it are wrong in time_embed.
modelscope/DiffSynth-Studio#562 ("999.3986->1000. 988.4937->988. 987.1741 -> 988."), #1025 (keep the timestep in
fp32, cast only before the time MLP), huggingface/diffusers#9405 (Flux and SD3 in bf16: 750 -> 752)."""
import math
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "time_embed", "families": ["constant", "range", "divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward"}

D, FREQ_DIM = 64, 256


class TimestepEmbedding(nn.Module):
    """diffusers' get_timestep_embedding (max period 10000) then the time MLP."""
    def __init__(self):
        super().__init__(); self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, D), nn.SiLU(), nn.Linear(D, 2 * D))
    def forward(self, t, like):
        t = t.to(like.dtype)                                   # the pipeline's cast: 998.39 -> 1000 in bf16
        half = FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], -1))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(16, D); self.time_embed = TimestepEmbedding(); self.out = nn.Linear(D, 16)
        with torch.no_grad():   # a trained adaLN: the timestep sets scale and shift of order 1
            self.time_embed.mlp[2].weight.mul_(4.0)
    def forward(self, x, t):
        h = self.patch(x)
        scale, shift = self.time_embed(t, h).unsqueeze(1).chunk(2, -1)
        return self.out(F.layer_norm(h, (D,)) * (1 + scale) + shift)


def build_model():
    torch.manual_seed(0); return Denoiser()

def _steps(n):
    """A shifted flow-matching schedule (shift 5, as Wan and SD3 sample): most steps near t = 1000, none integer."""
    s = torch.linspace(1.0, 0.02, 50)
    return (1000.0 * 5 * s / (1 + 4 * s))[:n]

def example_inputs():
    torch.manual_seed(1); return (torch.randn(8, 12, 16), _steps(8))

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        t = 1000.0 * torch.rand(8, generator=g); x = torch.randn(8, 12, 16, generator=g)
        yield (x, t), torch.randn(8, 12, 16, generator=g)

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
