"""The coverage benchmark's diffusers models: tiny configs, random init, nothing downloaded.

    from coverage_diffusers import DIFFUSERS_MODELS, build_diffusers
    model, kwargs = build_diffusers("sd3_transformer", "meta")

Each entry is a diffusers model class, the small config it is built from (the sizes diffusers' own tests use:
two blocks, 32-64 channels, 8-16 latent pixels) and the forward's keyword inputs. The classes cover a latent
diffusion UNet, the transformer backbones of DiT, PixArt-alpha, Stable Diffusion 3 and Flux, and the VAE.
"""
from __future__ import annotations

import torch

# name: (diffusers class, config kwargs, inputs kind)
DIFFUSERS_MODELS: dict[str, tuple[str, dict, str]] = {
    "unet2d_condition": ("UNet2DConditionModel", dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8), "unet"),
    "dit_transformer": ("DiTTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000), "dit"),
    "transformer2d_cross": ("Transformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=2, cross_attention_dim=32,
        norm_num_groups=8), "transformer2d"),
    "pixart_transformer": ("PixArtTransformer2DModel", dict(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=32,
        in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6),
        "pixart"),
    "sd3_transformer": ("SD3Transformer2DModel", dict(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=16), "sd3"),
    "flux_transformer": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)), "flux"),
    "autoencoder_kl": ("AutoencoderKL", dict(
        block_out_channels=(32, 64), in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4, norm_num_groups=32), "vae"),
}
TEXT_TOKENS = 8


def _inputs(kind: str, device: str) -> dict:
    r = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    t = torch.tensor([10], device=device)
    if kind == "unet":
        return {"sample": r(1, 4, 16, 16), "timestep": t, "encoder_hidden_states": r(1, TEXT_TOKENS, 32)}
    if kind == "dit":
        return {"hidden_states": r(1, 4, 8, 8), "timestep": t, "class_labels": torch.tensor([1], device=device)}
    if kind == "transformer2d":
        return {"hidden_states": r(1, 32, 8, 8), "encoder_hidden_states": r(1, TEXT_TOKENS, 32)}
    if kind == "pixart":
        return {"hidden_states": r(1, 4, 8, 8), "encoder_hidden_states": r(1, TEXT_TOKENS, 32), "timestep": t,
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    if kind == "sd3":
        return {"hidden_states": r(1, 4, 16, 16), "encoder_hidden_states": r(1, TEXT_TOKENS, 32),
                "pooled_projections": r(1, 64), "timestep": t}
    if kind == "flux":   # a 4 x 4 latent as 16 tokens, with the (frame, row, column) ids the rotary embedding reads
        return {"hidden_states": r(1, 16, 4), "encoder_hidden_states": r(1, TEXT_TOKENS, 32),
                "pooled_projections": r(1, 32), "timestep": torch.tensor([1.0], device=device),
                "img_ids": torch.zeros(16, 3, device=device), "txt_ids": torch.zeros(TEXT_TOKENS, 3, device=device)}
    return {"sample": r(1, 3, 32, 32)}


def build_diffusers(name: str, device: str):
    """(model, forward kwargs) for ``name`` of DIFFUSERS_MODELS, built on ``device``."""
    import diffusers

    cls_name, config, kind = DIFFUSERS_MODELS[name]
    with torch.device(device):
        model = getattr(diffusers, cls_name)(**config)
    return model, _inputs(kind, device)
