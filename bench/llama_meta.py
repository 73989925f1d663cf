"""A Llama-style decoder that can be built on the meta device (no weight memory) and traced by torch.fx.

The default shape is Llama-3-70B: 80 layers, hidden 8192, 64 query heads over 8 key/value heads (grouped-query
attention), SwiGLU MLP of 28672, vocabulary 128256, untied lm_head, RMSNorm eps 1e-5, rotary positions.
Built on ``device="meta"`` it holds shapes only, so an audit can trace and shape-propagate it on a laptop.

    from llama_meta import build_llama, example_input_ids   # (run from bench/, or put bench/ on sys.path)
    model = build_llama()                                   # 70B parameters, about 0 bytes
    ids = example_input_ids()                               # (1, 2048) int64 on meta
    gm = torch.fx.symbolic_trace(model)

    small = build_llama(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100, device="cpu")
    logits = small(example_input_ids(batch=2, seq=16, vocab=100, device="cpu"))   # (2, 16, 100)

Everything in ``forward`` is traceable: no Python branch looks at tensor values, the rotary tables are
computed from the traced sequence length, and the causal mask is SDPA's ``is_causal``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 80
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    ffn: int = 28672
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of even width, and "
                             f"heads into {self.kv_heads} key/value groups")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, written out as in the reference implementation."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables (seq, head_dim) for the positions 0..seq-1 of the current input."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def _repeat_kv(self, x: torch.Tensor, batch, seq) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        x = x[:, :, None].expand(batch, self.kv_heads, groups, seq, self.head_dim)
        return x.reshape(batch, self.heads, seq, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = self._repeat_kv(k, batch, seq), self._repeat_kv(v, batch, seq)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    """input_ids (batch, seq) int64 -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_llama(layers: int = 80, hidden: int = 8192, heads: int = 64, kv_heads: int = 8, ffn: int = 28672,
                vocab: int = 128256, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
    """The decoder with the given shape, constructed directly on ``device`` (meta: no weight memory)."""
    cfg = LlamaConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg)
    return model.eval()


def example_input_ids(batch: int = 1, seq: int = 2048, device: str | torch.device = "meta",
                      vocab: int = 128256, seed: int = 1) -> torch.Tensor:
    """(batch, seq) int64 token ids; random (seeded) on a real device, shape-only on meta."""
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
