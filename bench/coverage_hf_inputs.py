"""Forward inputs for a transformers model built from a (shrunk) default config, chosen by name, never by model.

    kwargs = inputs(model, config, "meta")

The main input follows ``main_input_name``: token ids; pixels (a clip of ``num_frames`` frames where the config
names a frame count); audio through the model type's own feature extractor on one second of noise (its layout,
mel bins and masks), else generic features or samples. A vision tower that takes flattened patches with their
``grid_thw`` gets a small grid of patches sized by its config (patch, temporal patch, channels, merge size).
Every other forward parameter without a default is filled by its name when it is a kind listed here (ids, masks,
pixels, audio); an encoder-decoder also gets decoder ids, a dual encoder pixels beside its ids.
"""
from __future__ import annotations

import inspect
import re

import torch

VOCAB = 256
SEQ = 16
GRIDS = ("grid_thw", "image_grid_thw")
AUDIO = ("input_features", "input_values", "audio_values")
SERIES = {   # a time series' other inputs, from its values: none padded, all observed, the first frequency
    "past_values_padding": torch.zeros_like,
    "past_observed_mask": torch.ones_like,
    "freq": lambda values: torch.zeros(values.shape[0], 1, dtype=torch.long, device=values.device),
}


def _token_ids_named(config, word: str):
    """The id of the placeholder token for ``word`` ("image"), when the model splices features into the text."""
    for key, value in vars(config).items():
        if word in key and re.search(r"token_(id|index)$", key):
            return value
    return None


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sub(config, *names):
    for name in names:
        sub = getattr(config, name, None)
        if sub is not None and not isinstance(sub, (int, float, str, list, dict)):
            return sub
    return config


def _size(value):
    return int(value[-1] if isinstance(value, (list, tuple)) else value)


def _image(config, device):
    vision = _sub(config, "vision_config", "backbone_config")
    size = getattr(vision, "image_size", None) or getattr(config, "image_size", None) or 224
    size = size if isinstance(size, (list, tuple)) else (size, size)
    channels = getattr(vision, "num_channels", None) or 3
    frames = getattr(vision, "num_frames", None) or getattr(config, "num_frames", None)
    shape = (1, channels, int(size[0]), int(size[-1]))
    if isinstance(frames, int) and not isinstance(frames, bool) and frames > 0:   # a video model: one clip
        shape = (1, frames, *shape[1:])
    return torch.randn(*shape, device=device)


def _patches(config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened patches of a 1 x 2m x 2m grid (m the spatial merge) and that grid_thw, for a vision tower."""
    patch = _size(getattr(config, "patch_size", None) or 14)
    temporal = _size(getattr(config, "temporal_patch_size", None) or 1)
    channels = int(getattr(config, "in_channels", None) or getattr(config, "num_channels", None) or 3)
    merge = _size(getattr(config, "spatial_merge_size", None) or getattr(config, "merge_size", None) or 1)
    grid = torch.tensor([[1, 2 * merge, 2 * merge]], device=device)
    return torch.randn(4 * merge * merge, channels * temporal * patch * patch, device=device), grid


def _feature_extractor(config):
    from transformers.models.auto.feature_extraction_auto import (
        FEATURE_EXTRACTOR_MAPPING_NAMES, feature_extractor_class_from_name)

    name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    cls = feature_extractor_class_from_name(name) if name else None
    if cls is None:
        return None
    audio = _sub(config, "audio_config", "encoder_config", "encoder")
    bins = getattr(audio, "num_mel_bins", None)
    try:   # the extractor's mel bins as the config's encoder expects them
        return cls(feature_size=bins) if isinstance(bins, int) else cls()
    except TypeError:
        return cls()


def _audio(config, main: str, params, device) -> dict:
    """The feature extractor's outputs on one second of noise that the forward takes, else generic audio."""
    import numpy as np

    try:
        extractor = _feature_extractor(config)
    except Exception:   # noqa: BLE001 - an extractor needing a library or files: the generic input below
        extractor = None
    if extractor is not None:
        rate = int(getattr(extractor, "sampling_rate", None) or 16000)
        noise = np.random.default_rng(0).standard_normal(rate).astype(np.float32) * 0.1
        try:
            out = extractor(noise, sampling_rate=rate, return_tensors="pt")
        except Exception:   # noqa: BLE001 - one that refuses these samples
            out = {}
        kept = {k: v.to(device) for k, v in out.items() if k in params and isinstance(v, torch.Tensor)}
        if main in kept:
            return kept
    if main == "input_features":
        audio = _sub(config, "audio_config", "encoder")
        bins = int(getattr(audio, "num_mel_bins", None) or getattr(audio, "feature_size", None) or 80)
        frames = 2 * int(getattr(audio, "max_source_positions", None) or 1500)
        return {"input_features": torch.randn(1, bins, frames, device=device)}
    return {main: torch.randn(1, 16000, device=device)}


def _main(model, config, main: str, params, ids, device) -> dict:
    grid = next((g for g in GRIDS if g in params and params[g].default is inspect.Parameter.empty), None)
    if grid:
        patches, thw = _patches(config, device)
        kwargs = {"hidden_states" if "hidden_states" in params else main: patches, grid: thw}
        if "merge_sizes" in params:
            kwargs["merge_sizes"] = thw.new_tensor([int(thw[0, 1]) // 2])
        return kwargs
    if main in ("pixel_values", "pixel_values_videos"):
        return {main: _image(config, device)}
    if main in AUDIO:
        return _audio(config, main, params, device)
    if main == "past_values" and _int(getattr(config, "context_length", None)):   # a time series
        channels = getattr(config, "num_input_channels", None)
        shape = (1, config.context_length) + ((channels,) if _int(channels) else ())
        return {main: torch.randn(*shape, device=device)}
    if main in params and main != "input_ids":
        raise ValueError(f"main input {main!r}: no generic example input for it")
    return {"input_ids": ids}


def _required(model, config, params, kwargs: dict, ids, device) -> None:
    """Fill the forward's parameters without a default that ``kwargs`` lacks, by name, where the name is known."""
    for name, param in params.items():
        if name in kwargs or param.default is not inspect.Parameter.empty or param.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name.endswith("input_ids"):
            kwargs[name] = ids
        elif name.endswith("attention_mask"):
            kwargs[name] = torch.ones_like(ids)
        elif name in ("pixel_values", "pixel_values_videos"):
            kwargs[name] = _image(config, device)
        elif name in SERIES and "past_values" in kwargs:
            kwargs[name] = SERIES[name](kwargs["past_values"])
        elif name in AUDIO:
            kwargs.update({k: v for k, v in _audio(config, name, params, device).items() if k not in kwargs})


def inputs(model, config, device) -> dict:
    """Forward kwargs for ``model`` (built from ``config``) on ``device``."""
    main = getattr(model, "main_input_name", "input_ids")
    params = inspect.signature(model.forward).parameters
    text = _sub(config, "text_config", "decoder", "encoder")
    vocab = int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VOCAB)
    ids = torch.randint(3, max(4, min(vocab, VOCAB)), (1, SEQ), device=device)
    kwargs = _main(model, config, main, params, ids, device)
    if main == "input_ids" and "pixel_values" in params and _token_ids_named(config, "image") is None:
        kwargs["pixel_values"] = _image(config, device)   # a dual encoder (CLIP-like) embeds both
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = ids[:, : SEQ // 2]
    _required(model, config, params, kwargs, ids, device)
    return kwargs
