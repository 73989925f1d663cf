"""VAE that returns its own loss, the KL term written as in pytorch/examples' vae/main.py, -0.5 * sum(1 + logvar - mu^2
- exp(logvar)) summed over the batch: under fp16 autocast mu and logvar come out of fp16 Linears and the sum's result
is stored in fp16, so a batch of 64 with a 128-dim latent whose posterior sits a few units from the prior (KL ~1200
nats a sample) totals ~7.8e4, past 65504: inf in kld, and the loss is inf. The per-element terms are all small; only
the sum overflows. NVIDIA/apex#812 (a VAE under AMP: the KL term "blows up", everything else trains) and
tensorflow/tensorflow#47156 ("the mean computation may overflow ... due to the sum before division")."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "kld", "families": ["nonfinite", "range"],
          "target": {"device": "cpu", "dtype": "float16"}, "phase": "forward"}

D, LATENT = 64, 128


class GaussianKL(nn.Module):
    def forward(self, mu, logvar):
        return -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, 256), nn.ReLU()); self.mu = nn.Linear(256, LATENT)
        self.logvar = nn.Linear(256, LATENT); self.dec = nn.Sequential(nn.Linear(LATENT, 256), nn.ReLU(),
                                                                       nn.Linear(256, D))
        self.kld = GaussianKL()
        with torch.no_grad():   # a posterior a few units from the prior (mu std ~4, as with a small KL weight)
            self.mu.weight.mul_(18.0)
    def forward(self, x, eps):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + eps * torch.exp(0.5 * logvar)              # eps: the reparameterization noise, given for determinism
        return F.mse_loss(self.dec(z), x, reduction="sum") + self.kld(mu, logvar)


def build_model():
    torch.manual_seed(0); return VAE()

def _batch(g):
    return torch.randn(64, D, generator=g), torch.randn(64, LATENT, generator=g)

def example_inputs():
    return _batch(torch.Generator().manual_seed(1))

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        yield _batch(g), None

def loss_fn(output, target):
    return output.float() / 64                                # the per-sample negative ELBO
