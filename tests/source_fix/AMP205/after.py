"""binary_cross_entropy on probabilities: CUDA autocast refuses it."""
import torch, torch.nn as nn, torch.nn.functional as F

FIX = {"rule": "AMP205", "device": "cuda", "dtype": "float16", "calibrate": False, "unsafe": False}

EXPECT = {"rule": "AMP205", "target": {"device": "cuda", "dtype": "float16"}, "calibrate": False}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x, y):
        p = torch.sigmoid(self.net(x))
        # fp32 under autocast (AMP205): binary_cross_entropy in fp32
        with torch.autocast(device_type=p.device.type, enabled=False):
            return F.binary_cross_entropy(p.float(), y)


def build_model():
    torch.manual_seed(0)
    return Classifier()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(8, 16), torch.rand(8, 1))
