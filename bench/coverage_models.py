"""The coverage benchmark's model zoo: which models, and how each is built with example inputs.

    from coverage_models import FAMILIES, list_models, build
    specs = list_models(["torchvision-cls", "timm"], timm_count=160)    # [{"family": ..., "name": ...}, ...]
    built = build(specs[0], device="meta")   # Built(model, args, kwargs, device), model in eval mode

Models are built on the ``meta`` device where that works (no weight memory, no init time); the eager forward then
runs on meta tensors, which is all the static audit needs. A model whose build or forward fails on meta is built
again on CPU with real weights. Detection models are built on CPU from the start: their forward runs
data-dependent NMS on real boxes, and the dispatch capture runs it for real. Nothing is downloaded
(``weights=None``, ``pretrained=False``, configs from code, ``HF_HUB_OFFLINE=1``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

from coverage_diffusers import DIFFUSERS_MODELS, build_diffusers

FAMILIES = ("torchvision-cls", "torchvision-det", "torchvision-seg", "torchvision-video", "torchvision-flow", "timm",
            "transformers", "transformers-all", "diffusers")

# Detection models at a small image size and with few proposals and detections: the forward stays a few seconds
# on CPU, and every branch (RPN, NMS, RoI heads, mask/keypoint heads) still runs. (name prefix, extra kwargs)
DET_KWARGS = (
    ("ssd", dict(detections_per_img=10, topk_candidates=100)),
    ("retinanet", dict(min_size=128, max_size=160, detections_per_img=10, topk_candidates=100)),
    ("fcos", dict(min_size=128, max_size=160, detections_per_img=10, topk_candidates=100)),
    ("", dict(min_size=128, max_size=160, rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=50,
              box_detections_per_img=10)),
)
DET_IMAGE = (3, 120, 160)
CLS_INPUT = (1, 3, 224, 224)
# Video clips (batch, channels, frames, height, width): the smallest each family's fixed pooling or positional
# tables accept (S3D pools a (2, 7, 7) window after 8x temporal and 32x spatial strides; MViT's positional tables
# are 16 x 224 x 224); the others pool adaptively (Swin3D pads to its windows), so 4 x 56 x 56 clips: fp16 conv3d
# on CPU, which --calibrate runs, is a slow reference kernel. Optical flow: two frames whose side is a multiple
# of 8, 4 levels of RAFT's pyramid deep.
VIDEO_INPUTS = (("s3d", (1, 3, 16, 224, 224)), ("mvit", (1, 3, 16, 224, 224)), ("", (1, 3, 4, 56, 56)))
FLOW_IMAGE = (1, 3, 128, 128)

# Name fragments of small timm variants, most preferred first: the benchmark takes the smallest-sounding models
# of each timm module, so it spans architectures rather than sizes of one.
TIMM_SMALL = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "mobile", "lite", "18", "b0", "s")

# Tiny transformers configs: random init, 2 layers, hidden 32, vocab 256, sequence 16.
HF_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=256,
                 max_position_embeddings=64, use_cache=False)
HF_SEQ = 16
# model_type: (config overrides, inputs) with inputs "text", "seq2seq", "image", "audio" or "text+image".
HF_MODELS: dict[str, tuple[dict, str]] = {
    "bert": ({}, "text"),
    "roberta": ({}, "text"),
    "distilbert": (dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64), "text"),
    "albert": (dict(embedding_size=16), "text"),
    "electra": (dict(embedding_size=32), "text"),
    "deberta-v2": ({}, "text"),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=64), "text"),
    "gpt_neox": ({}, "text"),
    "opt": (dict(ffn_dim=64, word_embed_proj_dim=32), "text"),
    "llama": (dict(num_key_value_heads=2), "text"),
    "mistral": (dict(num_key_value_heads=2), "text"),
    "qwen2": (dict(num_key_value_heads=2), "text"),
    "phi": ({}, "text"),
    "gemma": (dict(num_key_value_heads=2, head_dim=8), "text"),
    "mixtral": (dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "text"),
    "t5": (dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4), "seq2seq"),
    "bart": (dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64), "seq2seq"),
    "vit": (dict(image_size=32, patch_size=8), "image"),
    "convnext": (dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], image_size=32), "image"),
    "swin": (dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4),
             "image"),
    "whisper": (dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                     max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=0,
                     eos_token_id=0, decoder_start_token_id=0), "audio"),
    "clip": (dict(text_config=dict(HF_COMMON, vocab_size=256), projection_dim=16,
                  vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, image_size=32, patch_size=8)), "text+image"),
}
# Configs of these kinds are given whole; text models start from HF_COMMON.
HF_WHOLE = ("image", "audio", "text+image")
HF_IMAGE = (1, 3, 32, 32)


@dataclass
class Built:
    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    device: str = "meta"
    spec: dict | None = None


def list_models(families: list[str], *, timm_count: int = 160) -> list[dict]:
    """Every model of the named families, as ``{"family", "name"}`` specs in a fixed order."""
    specs: list[dict] = []
    for family in families:
        names = _LISTERS[family](timm_count) if family == "timm" else _LISTERS[family]()
        specs.extend({"family": family, "name": n} for n in names)
    return specs


def build(spec: dict, device: str) -> Built:
    """Build ``spec``'s model on ``device`` ("meta" or "cpu") with example inputs, in eval mode."""
    torch.manual_seed(0)
    built = _BUILDERS[spec["family"]](spec["name"], device)
    built.model.eval()
    built.spec = spec
    return built


def devices_for(spec: dict) -> tuple[str, ...]:
    """The devices to try, in order: meta first, except detection (see the module docstring)."""
    return ("cpu",) if spec["family"] == "torchvision-det" else ("meta", "cpu")


def _torchvision():
    from coverage_tvops import import_torchvision

    return import_torchvision()[0]


# -- listing -----------------------------------------------------------------------------------------------------

def _tv_list(module_name: str | None) -> list[str]:
    tv = _torchvision()
    module = tv.models if module_name is None else getattr(tv.models, module_name)
    return sorted(tv.models.list_models(module=module))


def _timm_list(count: int) -> list[str]:
    _torchvision()   # timm imports torchvision
    import timm

    def rank(name: str) -> tuple:
        tokens = re.split(r"[_\.]", name)
        hits = [i for i, s in enumerate(TIMM_SMALL) if any(t.startswith(s) or t.endswith(s) for t in tokens)]
        return (min(hits) if hits else len(TIMM_SMALL), len(name), name)

    per_module = {m: sorted(timm.list_models(module=m), key=rank) for m in sorted(timm.list_modules())}
    per_module = {m: names for m, names in per_module.items() if names}
    picked: list[str] = []
    depth = 0
    # Round-robin over modules so every architecture gets in before any gets a second variant.
    while len(picked) < count and any(len(v) > depth for v in per_module.values()):
        for names in per_module.values():
            if depth < len(names) and names[depth] not in picked and len(picked) < count:
                picked.append(names[depth])
        depth += 1
    return picked


_LISTERS = {
    "torchvision-cls": lambda: _tv_list(None),
    "torchvision-det": lambda: _tv_list("detection"),
    "torchvision-seg": lambda: _tv_list("segmentation"),
    "torchvision-video": lambda: _tv_list("video"),
    "torchvision-flow": lambda: _tv_list("optical_flow"),
    "timm": _timm_list,
    "transformers": lambda: list(HF_MODELS),
    "transformers-all": lambda: _hf_all()[0](),
    "diffusers": lambda: list(DIFFUSERS_MODELS),
}


# -- building ----------------------------------------------------------------------------------------------------

def _on(device: str):
    return torch.device(device)


def _tv_cls(name: str, device: str) -> Built:
    tv = _torchvision()
    with _on(device):
        model = tv.models.get_model(name, weights=None)
    return Built(model, (torch.randn(*CLS_INPUT, device=device),), device=device)


def _tv_seg(name: str, device: str) -> Built:
    tv = _torchvision()
    with _on(device):
        model = tv.models.get_model(name, weights=None, weights_backbone=None)
    return Built(model, (torch.randn(*CLS_INPUT, device=device),), device=device)


def _tv_det(name: str, device: str) -> Built:
    tv = _torchvision()
    extra = next(kw for prefix, kw in DET_KWARGS if name.startswith(prefix))
    with _on(device):
        model = tv.models.get_model(name, weights=None, weights_backbone=None, **extra)
    return Built(model, ([torch.rand(*DET_IMAGE, device=device)],), device=device)


def _tv_video(name: str, device: str) -> Built:
    tv = _torchvision()
    shape = next(shape for prefix, shape in VIDEO_INPUTS if name.startswith(prefix))
    with _on(device):
        model = tv.models.get_model(name, weights=None)
    return Built(model, (torch.randn(*shape, device=device),), device=device)


def _tv_flow(name: str, device: str) -> Built:
    tv = _torchvision()
    with _on(device):
        model = tv.models.get_model(name, weights=None)
    return Built(model, (torch.rand(*FLOW_IMAGE, device=device), torch.rand(*FLOW_IMAGE, device=device)),
                 device=device)


def _hf_all():
    _torchvision()   # transformers imports torchvision when it is installed
    from coverage_hf import build_hf_all, hf_all_names

    return hf_all_names, build_hf_all


def _hf_any(name: str, device: str) -> Built:
    model, kwargs = _hf_all()[1](name, device)
    return Built(model, (), kwargs, device)


def _diffusers(name: str, device: str) -> Built:
    _torchvision()
    model, kwargs = build_diffusers(name, device)
    return Built(model, (), kwargs, device)


def _timm(name: str, device: str) -> Built:
    _torchvision()
    import timm

    with _on(device):
        model = timm.create_model(name, pretrained=False)
    size = tuple(getattr(model, "pretrained_cfg", {}).get("input_size") or CLS_INPUT[1:])
    return Built(model, (torch.randn(1, *size, device=device),), device=device)


def _hf(name: str, device: str) -> Built:
    _torchvision()   # transformers imports torchvision when it is installed
    import transformers

    overrides, kind = HF_MODELS[name]
    settings = overrides if kind in HF_WHOLE else {**HF_COMMON, **overrides}
    config = transformers.AutoConfig.for_model(name, **settings)
    with _on(device):
        model = transformers.AutoModel.from_config(config)
    vocab = int(getattr(config, "vocab_size", 256) or 256)
    ids = torch.randint(0, vocab, (1, HF_SEQ), device=device)
    if kind == "text":
        return Built(model, (), {"input_ids": ids}, device)
    if kind == "seq2seq":
        return Built(model, (), {"input_ids": ids, "decoder_input_ids": ids[:, : HF_SEQ // 2]}, device)
    pixels = torch.randn(*HF_IMAGE, device=device)
    if kind == "image":
        return Built(model, (), {"pixel_values": pixels}, device)
    if kind == "text+image":
        return Built(model, (), {"input_ids": ids, "pixel_values": pixels}, device)
    # audio: 2 x max_source_positions mel frames (the encoder's stride-2 conv halves them)
    features = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, device=device)
    return Built(model, (), {"input_features": features, "decoder_input_ids": ids[:, : HF_SEQ // 2]}, device)


_BUILDERS = {
    "torchvision-cls": _tv_cls,
    "torchvision-det": _tv_det,
    "torchvision-seg": _tv_seg,
    "torchvision-video": _tv_video,
    "torchvision-flow": _tv_flow,
    "timm": _timm,
    "transformers": _hf,
    "transformers-all": _hf_any,
    "diffusers": _diffusers,
}
