"""Detector whose forward returns its loss (as mmdetection's and torchvision's detectors do in training), a hand-written
sigmoid focal loss on the fp16 logits: p = sigmoid(logit) is exactly 1.0 in fp16 past logit ~8.3 and exactly 0 below
~-17, so log(1 - p) or log(p) is -inf, and the term that the target zeroes gives 0 * -inf = NaN in criterion. A trained
head's confident anchors are that far out. pytorch/pytorch#40497 (AMP NaN loss: "Focal Loss or Cross Entropy which
have log() ... we will find they are [0.]"; cast the sigmoid to float32) and facebookresearch/maskrcnn-benchmark#1048
(SigmoidFocalLoss under fp16); PyTorch refuses F.binary_cross_entropy under autocast for this reason."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "criterion", "families": ["nonfinite", "sensitive-op"],
          "target": {"device": "cpu", "dtype": "float16"}, "phase": "forward"}

ANCHORS, CLASSES = 64, 8


class SigmoidFocalLoss(nn.Module):
    """RetinaNet's loss written out (Lin et al. 2017), alpha 0.25, gamma 2, per anchor."""
    def forward(self, logits, targets):
        p = torch.sigmoid(logits)
        pos = -0.25 * (1 - p) ** 2 * targets * torch.log(p)
        neg = -0.75 * p ** 2 * (1 - targets) * torch.log(1 - p)
        return (pos + neg).sum(-1)


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU()); self.cls_head = nn.Linear(64, CLASSES)
        self.criterion = SigmoidFocalLoss()
        with torch.no_grad():   # a trained head: confident anchors sit at logits of about +-8 to +-14
            self.cls_head.weight.mul_(18.0)
    def forward(self, feats, targets):
        return self.criterion(self.cls_head(self.backbone(feats)), targets)


def build_model():
    torch.manual_seed(0); return Detector()

def _batch(g):
    feats = torch.randn(2, ANCHORS, 32, generator=g)
    targets = (torch.rand(2, ANCHORS, CLASSES, generator=g) < 0.1).float()
    return feats, targets

def example_inputs():
    return _batch(torch.Generator().manual_seed(1))

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        yield _batch(g), None

def loss_fn(output, target):
    return output.float().mean()
