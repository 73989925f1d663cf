"""Models whose hazards sit inside functions torch.fx keeps opaque (torch.fx.wrap), as torchvision's Swin does.

Each wrapped model has a twin calling the same helper unwrapped (``*_plain``), whose findings it must match.
"""
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


def window_and_shift(shift_size, size, window_size):
    # swin3d's _get_window_and_shift_size: mutates its list arguments.
    for i in range(2):
        if size[i] <= window_size[i]:
            window_size[i] = size[i]
            shift_size[i] = 0
    return window_size, shift_size


def masked_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)
    scores = scores.masked_fill(mask, -1e9)
    return scores.softmax(-1) @ v


def window_cosine_attention(x, qkv_weight, window_size, shift_size):
    # Swin V2's shifted_window_attention in small: control flow on the padded shape, cosine attention.
    _, h, w, c = x.shape
    shift_size = shift_size.copy()
    if window_size[0] >= h:
        shift_size[0] = 0
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(-shift_size[0],), dims=(1,))
    q, k, v = F.linear(x, qkv_weight).chunk(3, -1)
    attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    return attn.softmax(-1) @ v


for _name in ("window_and_shift", "masked_attention", "window_cosine_attention"):
    torch.fx.wrap(_name)


class Swin3dWindows(nn.Module):
    def __init__(self):
        super().__init__()
        self.window_size, self.shift_size = [8, 8], [4, 4]
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        _, h, w, _ = x.shape
        window, shift = window_and_shift(self.shift_size.copy(), [h, w], self.window_size.copy())
        return torch.roll(self.proj(x), shifts=(-shift[0], -shift[1]), dims=(1, 2)) * window[0]


class MaskedAttention(nn.Module):
    wrapped = True

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).triu(1))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.wrapped:
            return masked_attention(q, k, v, self.mask)
        return _unwrapped_masked_attention(q, k, v, self.mask)


class MaskedAttentionPlain(MaskedAttention):
    wrapped = False


class CosineWindows(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = nn.Parameter(torch.randn(48, 16) * 0.1)
        self.window_size, self.shift_size = [4, 4], [2, 2]

    def forward(self, x):
        return window_cosine_attention(x, self.attn.qkv, self.window_size, self.shift_size)


def _unwrapped_masked_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)
    scores = scores.masked_fill(mask, -1e9)
    return scores.softmax(-1) @ v


def clamp_scores(s):
    return s.masked_fill(s > 0, -1e9)


class LeafAttention(nn.Module):
    def forward(self, s):
        return s.masked_fill(s > 0, -1e9).softmax(-1)


class CustomTraced(nn.Module):
    """Traced by the user's own tracer: ``clamp_scores`` autowrapped, ``LeafAttention`` a leaf."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.attn = LeafAttention()

    def forward(self, x):
        return self.attn(clamp_scores(self.fc(x)))


class LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, LeafAttention) or super().is_leaf_module(m, qualname)


def custom_traced():
    model = CustomTraced()
    return torch.fx.GraphModule(model, LeafTracer(autowrap_functions=(clamp_scores,)).trace(model))


def build_swin3d():
    return Swin3dWindows()


def add_floor(x):
    # A tensor built from constants inside the body: fx stores it on the graph module.
    return torch.maximum(x, torch.full((16,), -1e9))


torch.fx.wrap("add_floor")


class Floor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return add_floor(self.fc(x))


def scale_from_data(x):
    # Reads tensor data: neither fx nor a fake-tensor run can follow it.
    return x * float(x.abs().max().numpy())


torch.fx.wrap("scale_from_data")


class DataScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(scale_from_data(x))
