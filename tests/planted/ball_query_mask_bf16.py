"""PointNet++-style ball query on a LiDAR-sized scene: neighbours are the points within ``radius`` of each centre,
found with the expanded squared distance ``|a|^2 + |b|^2 - 2 a.b`` (the ``square_distance`` of the common PyTorch
ports) and the mask ``dist > radius ** 2``. Under autocast ``a @ b^T`` is a bf16 GEMM: with coordinates ~20 m from
the origin its value is ~800, stored in steps of 4, so the distance is off by metres squared against a radius of
0.5 m and the mask (which point is in the ball) is largely noise, though every value is finite.
yanx27/Pointnet_Pointnet2_pytorch#151 (the expanded square distance gives wrong, negative distances and wrong ball
query indices), open-mmlab/mmdetection3d#1207 (knn and ball query kept in fp32 for fp16 training), NVIDIA/cuvs#991
(the expanded L2 with a half-precision dot product: negative distances)."""
import torch, torch.nn as nn, torch.nn.functional as F

EXPECT = {"culprit": "group", "families": ["divergence"],
          "target": {"device": "cpu", "dtype": "bfloat16"}, "phase": "forward",
          "decisions": {"op": "gt", "min_share": 0.02}}

class BallGroup(nn.Module):
    def __init__(self, radius=0.5):
        super().__init__(); self.radius = radius
    def forward(self, centres, points, feats):
        dist = (-2 * centres @ points.transpose(-2, -1) + (centres ** 2).sum(-1, keepdim=True)
                + (points ** 2).sum(-1).unsqueeze(-2))
        outside = dist > self.radius ** 2                      # the neighbourhood: decided on a bf16 GEMM
        w = (~outside).to(feats.dtype)
        return (w @ feats) / w.sum(-1, keepdim=True).clamp_min(1.0)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.embed = nn.Linear(3, 16); self.group = BallGroup(); self.head = nn.Linear(16, 4)
    def forward(self, points):
        centres = points[:, ::4]
        return self.head(self.group(centres, points, F.relu(self.embed(points - points.mean(1, keepdim=True)))))

def _scene(g):
    # 256 points of one object 20 m from the sensor, spread over 2 m
    return torch.tensor([20.0, 5.0, 1.0]) + torch.rand(2, 256, 3, generator=g) * 2.0

def build_model():
    torch.manual_seed(0); return Net()

def example_inputs():
    return (_scene(torch.Generator().manual_seed(1)),)

def train_data():
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = _scene(g); yield x, x[:, ::4, :1].expand(-1, -1, 4).contiguous()

def loss_fn(output, target):
    return F.mse_loss(output.float(), target)
