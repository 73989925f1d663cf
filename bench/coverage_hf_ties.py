"""Sizes a transformers config ties to other sizes, kept tied after ``coverage_hf.shrink`` lowered them.

    keep_ties(config, before)     # before: dict(vars(config)) from before the shrink; config is changed in place
    config = rebuilt(config)      # the same values through the class's own constructor: derived sizes recomputed

Each rule is a relation between attribute names that the default config satisfies, re-established on the
shrunk values (a relation the default config does not satisfy is left alone):
  head width      a ``head_dim`` left None becomes hidden // heads, the width the model derives anyway
  rotary widths   ``rotary_dim`` and the like, and the ``*_section`` lists of rope parameters (mrope), scale with
                  the head width, so they still fit inside it (and still sum to its rotary half)
  per layer       lists as long as the layer count (``layer_types``, sparsity patterns) take the new count: their
                  first entries, or, where the constructor derives the list when unset, what it derives for it
  head products   ``X_heads * X_head_dim`` that equalled ``expand * hidden_size`` (mamba's inner width) or another
                  ``X_*`` size still does
``rebuilt`` re-runs the constructor, so sizes a config computes from others (MLA's ``qk_head_dim`` as nope + rope)
follow the shrunk ones; a config whose constructor refuses them is kept as shrunk.
"""
from __future__ import annotations

import dataclasses
import re

ROTARY = re.compile(r"^(.*_)?(rotary_dim|rotary_ndims|rotary_emb_dim|rope_dim)$")
LAYER_COUNTS = re.compile(r"^(.*_)?(num_hidden_layers|n_layers?)$")   # not num_layers: swin's is its stages
HEADS = re.compile(r"^(.*?)(n_heads|num_heads)$")
HEAD_WIDTHS = ("d_head", "head_dim")
HIDDEN = ("hidden_size", "n_embd", "d_model")
HEAD_COUNTS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
PART_COUNTS = re.compile(r"^(.*_)?num_\w*shared\w*_layers$")   # layers that reuse another layer's cache


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_width(values: dict):
    """The attention head width a config's values give (``head_dim``, else hidden // heads), or None."""
    if _int(values.get("head_dim")):
        return values["head_dim"]
    hidden = next((values[k] for k in HIDDEN if _int(values.get(k))), None)
    heads = next((values[k] for k in HEAD_COUNTS if _int(values.get(k))), None)
    return hidden // heads if hidden and heads else None


def split_sum(parts: list[int], total: int) -> list[int]:
    """``parts`` rescaled to positive integers summing to ``total`` (largest remainders first)."""
    old = sum(parts)
    exact = [p * total / old for p in parts]
    out = [max(1, int(e)) for e in exact]
    order = sorted(range(len(parts)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order * len(parts):
        if sum(out) >= total:
            break
        out[i] += 1
    for i in sorted(range(len(parts)), key=lambda i: -out[i]) * len(parts):
        if sum(out) <= total:
            break
        if out[i] > 1:
            out[i] -= 1
    return out


def per_layer(values: list, count: int) -> list:
    """A per-layer list for ``count`` layers: its first ``count`` entries, the layers a shrunk model builds."""
    return list(values[:count])


def _rescale_sections(rope, factor: float):
    if isinstance(rope, dict):
        return {k: (split_sum(list(v), max(len(v), round(sum(v) * factor)))
                    if k.endswith("section") and all(_int(x) for x in v or [None]) and v
                    else _rescale_sections(v, factor)) for k, v in rope.items()}
    return rope


def _head_ties(config, before: dict) -> None:
    now = vars(config)
    if "head_dim" in now and now["head_dim"] is None:
        width = head_width(now)
        if width:
            config.head_dim = width
    if _int(before.get("kv_lora_rank")) and before.get("num_key_value_heads") == before.get("num_attention_heads"):
        config.num_key_value_heads = config.num_attention_heads   # MLA expands its latent to every head
    old, new = head_width(before), head_width(vars(config))
    if not (old and new) or new >= old:
        return
    for key, value in list(vars(config).items()):
        if ROTARY.match(key) and _int(before.get(key)) and before[key] > 2:   # from its own default value
            setattr(config, key, max(2, before[key] * new // old // 2 * 2))
        elif "rope" in key and isinstance(value, dict):
            setattr(config, key, _rescale_sections(value, new / old))
    rope = vars(config).get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in getattr(config, "ignore_keys_at_rope_validation", ()) \
            and "mrope_section" not in rope:   # the model's own default sections fit the default head width
        rotary = int(new * rope.get("partial_rotary_factor", 1.0))
        rope["mrope_section"] = split_sum([2, 3, 3], rotary // 2)


def _layer_ties(config, before: dict) -> None:
    counts = {before[k]: getattr(config, k) for k in before if LAYER_COUNTS.match(k) and _int(before[k])
              and _int(vars(config).get(k)) and vars(config)[k] < before[k]}
    for key, value in before.items():   # a part of the layers (those sharing a cache) shrinks with the whole
        if PART_COUNTS.match(key) and not LAYER_COUNTS.match(key) and _int(value):
            whole = max((old for old in counts if old > value), default=None)
            if whole:
                setattr(config, key, value * counts[whole] // whole)
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) in counts and not key.startswith("_") \
                and not any(_int(v) for v in value):   # stage lists of sizes are shrunk by name
            setattr(config, key, per_layer(list(value), counts[len(value)]))
            config._per_layer = getattr(config, "_per_layer", ()) + (key,)


def _product_ties(config, before: dict) -> None:
    for key in list(before):
        match = HEADS.match(key)
        width_key = next((match.group(1) + w for w in HEAD_WIDTHS if match and match.group(1) + w in before), None)
        if not width_key or not all(_int(before[k]) for k in (key, width_key)):
            continue
        prefix, product = match.group(1), before[key] * before[width_key]
        expand = next((k for k in before if k in (prefix + "expand", "expand") and _int(before[k])), None)
        width = getattr(config, width_key)
        if expand and _int(before.get("hidden_size")) and before[expand] * before["hidden_size"] == product:
            setattr(config, key, max(1, getattr(config, expand) * config.hidden_size // width))
            continue
        for other in before:
            if other.startswith(prefix) and prefix and other not in (key, width_key) and before[other] == product \
                    and _int(before[other]):
                setattr(config, other, getattr(config, key) * width)


def keep_ties(config, before: dict) -> None:
    """Re-establish, on ``config``'s shrunk values, the ties its values ``before`` the shrink had."""
    if vars(config).get("num_experts_per_tok", 0) is None and _int(before.get("n_routed_experts")):
        config.num_experts_per_tok = 2   # left unset, the router's top-k has no k
    _head_ties(config, before)
    _layer_ties(config, before)
    _product_ties(config, before)


def rebuilt(config, default=None, depth: int = 0):
    """``config``'s values (sub-configs rebuilt first) through its class's constructor; ``config`` if refused.

    ``default`` is the unshrunk config it came from: a value the constructor set back to the default's (a size
    kept under another name than the field's, which it re-derives from the field) is shrunk again.
    """
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            setattr(config, key, rebuilt(value, vars(default).get(key) if default is not None else None, depth + 1))
    cls = type(config)
    if not dataclasses.is_dataclass(cls):
        return config
    values, alias = vars(config), getattr(cls, "attribute_map", {}) or {}
    kwargs = {f.name: values[alias.get(f.name, f.name) if alias.get(f.name) in values else f.name]
              for f in dataclasses.fields(cls) if f.init and (f.name in values or alias.get(f.name) in values)}
    for f in dataclasses.fields(cls):   # a per-layer list the constructor derives is derived for the new count
        if f.name in getattr(config, "_per_layer", ()) and f.default is None:
            kwargs[f.name] = None
    try:
        new = cls(**kwargs)
    except Exception:   # noqa: BLE001 - a constructor that refuses the shrunk values keeps them as set
        return config
    old = vars(default) if default is not None else {}
    for key, value in values.items():
        if key != "_per_layer" and key not in vars(new) or _int(value) and key in old and vars(new)[key] == old.get(key) != value:
            setattr(new, key, value)   # set after construction (a wrapper's), or re-derived from the default
    return new
