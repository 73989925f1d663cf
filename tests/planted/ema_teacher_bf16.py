"""BYOL/MoCo-style self-distillation: the forward updates a momentum teacher (an EMA of the student, momentum 0.999)
in place, and the student learns to predict the teacher's features. Under O2 the teacher is cast to bf16 with the
rest of the model but, frozen, gets no FP32 master: each update moves a weight by ~1e-3 of its distance to the
student, below half a bf16 ulp of the weight, so round-to-nearest keeps almost none of it and the teacher stays
where it started. Training finishes and the loss looks fine. Published: huggingface/pytorch-image-models#1831
(ModelEma "doesn't work well if ema weights are float16 or bfloat16"), d8ahazard/sd_dreambooth_extension#1415
("almost all EMA weight updates get rounded down to 0 ... the ema model never actually gets updated"),
NUS-HPC-AI-Lab/VideoSys#6 and PaddlePaddle/PaddleMIX#515 (EMA moved to fp32).

    ampaudit train tests/planted/ema_teacher_bf16.py --opt-level O2 --dtype bfloat16 --device cpu --steps 20 --trace run.jsonl
"""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "teacher", "families": [], "target": {"device": "cpu", "dtype": "bfloat16"},
          "phase": "training", "opt_level": "O2", "tensors": ["teacher.0.weight", "teacher.2.weight"]}
MOMENTUM = 0.999


def encoder():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))


class SelfDistill(nn.Module):
    def __init__(self, momentum=MOMENTUM):
        super().__init__()
        self.momentum = momentum
        self.student = encoder()
        self.predictor = nn.Linear(32, 32)
        self.teacher = encoder()
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)      # moved by the EMA below, never by the optimizer

    @torch.no_grad()
    def update_teacher(self):
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.mul_(self.momentum).add_(s.detach(), alpha=1 - self.momentum)

    def forward(self, x):
        if self.training:
            self.update_teacher()
        online = self.predictor(self.student(x))
        with torch.no_grad():
            target = self.teacher(x)
        return torch.stack([online, target.to(online.dtype)])


def build_model():
    torch.manual_seed(0); return SelfDistill()

def example_inputs():
    torch.manual_seed(1); return (torch.randn(32, 16),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(400):
        yield torch.randn(32, 16, generator=g), torch.zeros(())

def loss_fn(output, target):
    online, teacher = output.float()
    return 2 - 2 * F.cosine_similarity(online, teacher, dim=-1).mean()

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
