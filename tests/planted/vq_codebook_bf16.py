"""VQ-VAE vector quantizer (van den Oord et al. 2017) whose nearest-code search expands the squared distance,
``|z|^2 - 2 z.e + |e|^2``, as the common implementations do to avoid materializing ``z - e``. Under autocast the
``z @ codebook.T`` GEMM is bf16: its error is relative to ``|z| |e|`` (~144 here), and latents that share a large
common component (3 per channel, the codes spread by 0.3 around it, the latents near their codes as after training)
make the gap between the nearest and the next code a small difference of large terms. The argmin picks another
code for 40% of the latents (``measure_decisions`` on ``example_inputs()``) and the decoder reads another vector;
the output is 5% off in relative L2. The encoder's own bf16 rounding of the latents flips none: it is the
expanded distance in bf16, not the latents, that decides. Published: rosinality/vq-vae-2-pytorch#65 (AMP training of VQ-VAE-2:
"safer to use fp32 for entire quantize operations", ``Quantize.forward`` under ``autocast(enabled=False)``),
lucidrains/vector-quantize-pytorch#114 (bf16 training uses ~50% of the codes against ~100% in fp32; quantization
moved to fp32). ``build_fixed_model`` is that fix: the quantizer runs in float32 on the encoder's output."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "quantizer", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward",
          "decisions": {"op": "argmin", "min_share": 0.03}}

D_IN, D, CODES = 32, 16, 256
OFFSET, SPREAD, NOISE = 3.0, 0.3, 0.1      # latent channels: a common 3, codes spread by 0.3 around it


def prototypes():
    """The inputs the codes were initialised from (a k-means initialisation from data leaves codes at latents)."""
    return torch.randn(CODES, D_IN, generator=torch.Generator().manual_seed(3))


def batch(n, g):
    """Inputs near the prototypes, as a trained VQ-VAE's latents sit near their codes."""
    return prototypes()[torch.randint(0, CODES, (n,), generator=g)] + NOISE * torch.randn(n, D_IN, generator=g)


class Quantizer(nn.Module):
    def __init__(self, fp32=False):
        super().__init__()
        self.fp32 = fp32
        self.codebook = nn.Embedding(CODES, D)

    def forward(self, z):
        if self.fp32:
            with torch.autocast(z.device.type, enabled=False):
                return self._quantize(z.float())
        return self._quantize(z)

    def _quantize(self, z):
        e = self.codebook.weight
        dist = z.pow(2).sum(-1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(-1)   # bf16 GEMM under autocast
        codes = dist.argmin(-1)
        q = self.codebook(codes)
        return z + (q.to(z.dtype) - z).detach()                 # straight-through estimator


class VQAutoencoder(nn.Module):
    def __init__(self, fp32_quantizer=False):
        super().__init__()
        self.encoder = nn.Linear(D_IN, D)
        self.quantizer = Quantizer(fp32_quantizer)
        self.decoder = nn.Linear(D, D_IN)
        with torch.no_grad():
            self.encoder.weight.mul_(SPREAD * 3 ** 0.5)      # U(+-1/sqrt(D_IN)) * this: channels ~SPREAD around OFFSET
            self.encoder.bias.fill_(OFFSET)
            self.quantizer.codebook.weight.copy_(self.encoder(prototypes()))

    def forward(self, x):
        return self.decoder(self.quantizer(self.encoder(x)))


def build_model():
    torch.manual_seed(0); return VQAutoencoder()

def build_fixed_model():
    torch.manual_seed(0); return VQAutoencoder(fp32_quantizer=True)

def example_inputs():
    return (batch(1024, torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = batch(256, g); yield x, x

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
