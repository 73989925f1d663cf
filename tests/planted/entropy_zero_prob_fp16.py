"""Classifier with an entropy out-of-distribution score, H = -sum(p * log p) over softmax(logits): in fp16 a class
whose logit is 17 or more below the top one has p below the smallest subnormal (6e-8), p is exactly 0, log p = -inf,
and 0 * -inf = NaN in the score for that sample. A confident 100-class classifier has such gaps on most samples.
kkirchheim/pytorch-ood#84 (the Entropy detector returns NaN: "softmax sometimes outputs 0.0, leading to log(0.0)";
fixed by clipping p) and huggingface/trl#7221 (entropy_from_logits NaN for zero-probability tokens, float16 logits;
fixed with xlogy)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "score", "families": ["nonfinite", "sensitive-op"],
          "target": {"device": "cpu", "dtype": "float16"}, "phase": "forward"}

CLASSES = 100


class EntropyScore(nn.Module):
    def forward(self, logits):
        p = F.softmax(logits, -1)
        return -(p * torch.log(p)).sum(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(48, 128), nn.ReLU())
        self.classifier = nn.Linear(128, CLASSES); self.score = EntropyScore()
        with torch.no_grad():   # a trained, confident classifier: logits spread ~5, the top class 20-30 above the last
            self.classifier.weight.mul_(20.0)
    def forward(self, x):
        return self.score(self.classifier(self.backbone(x)))


def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(16, 48),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        yield torch.randn(16, 48, generator=g), None

def loss_fn(output, target):
    return output.float().mean()          # an entropy regularizer: minimise the score on in-distribution data
