"""rules/policy/recipes.toml read as the recipe contract: names, short names, native support, fallback chain."""
import pytest

from ampaudit.errors import UsageError
from ampaudit.precision import recipes


def test_every_recipe_falls_back_to_high_precision_without_a_cycle():
    for name in recipes.recipe_names():
        seen, cur = [], name
        while cur not in recipes.HIGH_PRECISION:
            assert cur not in seen, f"fallback cycle through {cur}"
            seen.append(cur)
            cur = recipes.safer(cur)
        assert cur == "bfloat16"


def test_short_torchao_names_map_to_full_names():
    assert recipes.parse_recipes("tensorwise, rowwise,mxfp8,tensorwise") == (
        "float8_tensorwise", "float8_rowwise", "mxfp8")
    assert recipes.recipe("rowwise_with_gw_hp").grad_weight == "bfloat16"
    assert not recipes.recipe("rowwise_with_gw_hp").low_grad_weight
    assert recipes.recipe("float8_tensorwise").low_grad_weight


def test_unknown_recipe_is_a_usage_error_naming_it():
    with pytest.raises(UsageError, match="unknown recipe 'fp4'"):
        recipes.parse_recipes("tensorwise,fp4")


def test_native_recipes_follow_compute_capability():
    assert recipes.native_recipes(8.0) == ()
    hopper = recipes.native_recipes(9.0)
    assert "float8_tensorwise" in hopper and "mxfp8" not in hopper and "nvfp4" not in hopper
    assert {"mxfp8", "nvfp4"} <= set(recipes.native_recipes(10.0))


def test_choices_end_with_high_precision():
    assert recipes.choices()[-2:] == ("bfloat16", "float32")
    assert "nvfp4" in recipes.choices()
