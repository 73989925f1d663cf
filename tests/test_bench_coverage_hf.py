"""bench/coverage_hf_ties.py and coverage_hf_inputs.py: sizes kept tied through the shrink, inputs chosen by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from coverage_hf_ties import per_layer, split_sum  # noqa: E402


def test_split_sum_keeps_every_part_positive_and_hits_the_total():
    assert split_sum([16, 24, 24], 8) == [2, 3, 3]
    assert split_sum([8, 12, 12], 4) == [1, 2, 1]
    assert split_sum([1, 1, 30], 3) == [1, 1, 1]


def test_per_layer_lists_keep_the_layers_a_shrunk_model_builds():
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    assert per_layer(pattern * 5, 2) == ["sliding_attention", "sliding_attention"]
    assert per_layer(tuple([0.95] * 10 + [0.0] * 20), 2) == [0.95, 0.95]


def _shrunk(**values):
    transformers = pytest.importorskip("transformers")
    from coverage_hf import shrink

    return shrink(transformers.PretrainedConfig(**values))


def test_rotary_widths_and_rope_sections_follow_the_head_width():
    config = _shrunk(n_embd=4096, n_head=16, rotary_dim=64, hidden_size=4096, num_attention_heads=16,
                     rope_parameters={"rope_type": "default", "mrope_section": [64, 32, 32]})
    assert config.rotary_dim == 4                                   # 64 of 256, now of 16
    assert config.rope_parameters["mrope_section"] == [4, 2, 2]     # still half the head width


def test_per_layer_lists_and_shared_layer_counts_shrink_with_the_layers():
    config = _shrunk(num_hidden_layers=30, num_kv_shared_layers=10,
                     layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 6)
    assert config.num_hidden_layers == 2 and config.num_kv_shared_layers == 0
    assert config.layer_types == ["sliding_attention", "sliding_attention"]


def test_mla_keeps_a_kv_head_per_head_and_an_unset_head_dim_is_derived():
    config = _shrunk(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512)
    assert config.num_key_value_heads == config.num_attention_heads == 2
    assert _shrunk(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=None).head_dim == 16
    assert _shrunk(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8).num_key_value_heads == 1


def test_mamba_heads_still_fill_the_inner_width():
    config = _shrunk(hidden_size=4096, mamba_expand=2, mamba_n_heads=128, mamba_d_head=64)
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size
    config = _shrunk(hidden_size=4096, mamba_n_heads=128, mamba_d_head=8, mamba_d_ssm=1024)
    assert config.mamba_d_ssm == config.mamba_n_heads * config.mamba_d_head == 16


def test_tuple_stage_depths_and_heads_shrink_like_lists():
    config = _shrunk(depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), embed_dim=96, hidden_sizes=(64, 512))
    assert config.depths == [1, 1, 1, 1] and config.num_heads == [2, 2, 2, 2]
    assert tuple(config.hidden_sizes) == (64, 512)    # widths in tuples stay: other sizes are tied to them


def test_rebuilt_recomputes_what_a_config_derives():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config

    from coverage_hf import shrink
    from coverage_hf_ties import rebuilt

    config = rebuilt(shrink(DeepseekV3Config()))
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim == 32


class _Tower(torch.nn.Module):
    main_input_name = "pixel_values"

    def forward(self, hidden_states, grid_thw, **kwargs):
        return hidden_states


class _TwoInputs(torch.nn.Module):
    main_input_name = "pixel_values"

    def forward(self, pixel_values, qformer_input_ids, input_ids, attention_mask=None):
        return pixel_values


def test_inputs_give_towers_patches_with_their_grid_and_fill_required_ids():
    transformers = pytest.importorskip("transformers")
    from coverage_hf_inputs import inputs

    tower = transformers.PretrainedConfig(patch_size=14, temporal_patch_size=2, in_channels=3, spatial_merge_size=2)
    kwargs = inputs(_Tower(), tower, "cpu")
    assert kwargs["hidden_states"].shape == (16, 3 * 2 * 14 * 14) and kwargs["grid_thw"].tolist() == [[1, 4, 4]]
    config = transformers.PretrainedConfig(image_size=32, vocab_size=100)
    kwargs = inputs(_TwoInputs(), config, "cpu")
    assert set(kwargs) == {"pixel_values", "qformer_input_ids", "input_ids"}
    video = transformers.PretrainedConfig(image_size=32, num_frames=4, num_channels=3)
    assert inputs(_TwoInputs(), video, "cpu")["pixel_values"].shape == (1, 4, 3, 32, 32)


def test_rebuilt_keeps_sizes_stored_under_an_aliased_name():
    pytest.importorskip("transformers")
    from transformers.models.inkling.configuration_inkling import InklingVisionConfig

    from coverage_hf import shrink
    from coverage_hf_ties import rebuilt

    config = rebuilt(shrink(InklingVisionConfig()), InklingVisionConfig())   # stores num_hidden_layers as n_layers
    assert config.num_hidden_layers == 2 and config.hidden_size == 32


def test_a_per_layer_list_the_constructor_derives_is_derived_for_the_new_layer_count():
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from coverage_hf import shrink
    from coverage_hf_ties import rebuilt

    cls = CONFIG_MAPPING["neomme"]   # its last layer is global attention, which the model needs one of
    config = rebuilt(shrink(cls()), cls())
    assert config.layer_types == ["sliding_attention", "full_attention"]


def test_hf_eager_compare_names_what_runs_now_and_what_no_longer_does():
    from hf_eager import compare

    def rows(**eager):
        return [{"model": m, "eager": ok} for m, ok in eager.items()]

    gained, lost = compare(rows(a=True, b=False, c=True, d=True), rows(a=False, b=True, c=True))
    assert (gained, lost) == (["a"], ["b"])          # d is new to the list: neither
