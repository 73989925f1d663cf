"""Every transformers architecture, each from its own default config made small, with inputs it reads.

    from coverage_hf import hf_all_names, build_hf_all
    names = hf_all_names()                     # one model_type per distinct base-model class, sorted
    model, kwargs = build_hf_all("llama", "meta")

Nothing is hand-picked: the list is transformers' MODEL_MAPPING (the base model of each model type, aliases that
map to a class already listed dropped). Each config is the class's own defaults, shrunk generically by
``shrink``: every size it recognises by name (hidden width, layers, heads, feed-forward width, experts, vocab),
in the config and in each sub-config (text, vision, audio, encoder, decoder); sizes tied to others follow them
and the class's own constructor re-derives what it computes (``coverage_hf_ties``). The inputs follow the
model's ``main_input_name`` and the forward's required parameters, by name (``coverage_hf_inputs``). A model that does not build or run this way is reported with the reason (bench/coverage.py groups them).
"""
from __future__ import annotations

import re

import torch
from coverage_hf_inputs import VOCAB, inputs
from coverage_hf_ties import keep_ties, rebuilt

# Sizes by config attribute name: (regex on the name, the small value). A value is only ever lowered.
SIZES: tuple[tuple[str, int], ...] = (   # first match wins
    (r"(.*_)?(head_dim|d_kv|kv_channels|qk_rope_head_dim|qk_nope_head_dim|v_head_dim)", 16),
    (r"(.*_)?(intermediate_size|ffn_dim|d_ff|(en|de)coder_ffn_dim|n_inner|ffn_hidden_size|inner_dim|mlp_dim)", 64),
    (r"(.*_)?(hidden_size|d_model|n_embd|embed_dim|embedding_size|hidden_dim|dim|word_embed_proj_dim|"
     r"projection_dim|projection_size|d_embed|model_dim)", 32),
    (r"(.*_)?(num_hidden_layers|num_layers|n_layers?|(en|de)coder_layers|num_(en|de)coder_layers|depth|"
     r"num_blocks)", 2),
    (r"(.*_)?(num_attention_heads|n_heads?|num_heads|(en|de)coder_attention_heads)", 2),
    (r"(.*_)?(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)", 1),
    (r"(.*_)?lora_rank", 16),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", 4),
    (r"(num_experts_per_tok|moe_topk|top_k)", 2),
    (r"(n_group|topk_group|n_groups|num_expert_group|topk_expert_group)", 1),   # groups of the 4 experts, or heads
)
SIZE_RES = tuple((re.compile(f"^{pattern}$"), value) for pattern, value in SIZES)
# Sub-configs are attributes holding a config; lists of per-stage sizes shrink to one block per stage, 64 wide.
LIST_DEPTHS = re.compile(r"^(depths|num_layers|layers|block_repeats|num_blocks)$")
LIST_WIDTHS = re.compile(r"^(hidden_sizes|embed_dims?|dims|channels|widths|block_out_channels)$")
LIST_HEADS = re.compile(r"^(num_heads|num_attention_heads|n_heads)$")


def hf_all_names() -> list[str]:
    """model_types of transformers' MODEL_MAPPING, one per distinct base-model class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    by_class: dict[str, list[str]] = {}
    for model_type, cls in sorted(MODEL_MAPPING_NAMES.items()):
        by_class.setdefault(cls[0] if isinstance(cls, (tuple, list)) else cls, []).append(model_type)

    def own(cls: str, model_type: str) -> bool:   # LlamaModel is llama's, not exaone's that reuses it
        return cls.lower().startswith(re.sub(r"[-_]", "", model_type))

    return sorted(next((t for t in types if own(cls, t)), types[0]) for cls, types in by_class.items())


def _token_ids(config) -> int:
    """The largest special token id or index a config names (ids must stay inside the vocab)."""
    found = 0
    for key, value in vars(config).items():
        if isinstance(value, int) and not isinstance(value, bool) and re.search(r"token_(id|index)$", key):
            found = max(found, value)
    return found


def shrink(config, depth: int = 0):
    """Lower every size ``config`` (and its sub-configs) names to the small values above; returns config.

    Sizes other sizes are tied to follow them (``coverage_hf_ties``): per-layer lists take the new layer count, rotary
    widths and rope sections the new head width, a head count the width its product with a head width must fill.
    """
    from transformers import PretrainedConfig

    before = dict(vars(config))
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            shrink(value, depth + 1)
        elif isinstance(value, bool) or key.startswith("_"):
            continue
        elif isinstance(value, int) and key == "vocab_size":
            setattr(config, key, min(value, max(VOCAB, _token_ids(config) + 1)))
        elif isinstance(value, int):
            for regex, small in SIZE_RES:
                if regex.match(key) and value > small:
                    setattr(config, key, small)
                    break
        elif _int_list(value):
            _shrink_list(config, key, list(value))
    keep_ties(config, before)
    return config


def _int_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _shrink_list(config, key: str, value: list[int]) -> None:
    if LIST_DEPTHS.match(key):
        setattr(config, key, [min(v, 1) for v in value])
    elif LIST_WIDTHS.match(key) and isinstance(getattr(config, key), list):   # tuples: textnet ties them
        top = max(value)
        setattr(config, key, [max(8, (v * 64 // top) // 8 * 8) if top > 64 else v for v in value])
    elif LIST_HEADS.match(key):
        setattr(config, key, [min(v, 2) for v in value])


def _no_cache(config, depth: int = 0) -> None:
    # A returned DynamicCache is no output torch.export knows: a vision-language model's text config has its own flag.
    from transformers import PretrainedConfig

    if hasattr(config, "use_cache"):
        config.use_cache = False
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            _no_cache(value, depth + 1)


def build_hf_all(model_type: str, device: str):
    """(model, forward kwargs): ``model_type``'s base model from its shrunk default config, on ``device``."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = rebuilt(shrink(CONFIG_MAPPING[model_type]()), CONFIG_MAPPING[model_type]())
    _no_cache(config)
    with torch.device(device):
        model = transformers.AutoModel.from_config(config)
    return model, inputs(model, config, device)
