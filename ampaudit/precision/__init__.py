"""What a module computes in, below every engine that chooses it: the low-precision recipe table
(rules/policy/recipes.toml) and the plan JSON's reader, torchao's conversion of a Linear to a recipe with the
kernels emulated on CPU, and modules kept in float32 under autocast.

    recipes.py           recipe names, scaling, budgets, fallback chain; normalise_plan and PLAN_VERSION
    fp8.py               torchao, imported quietly; its float8 recipes; what a cast to fp8 flushes, clips, keeps
    convert.py           a Linear switched in place to a recipe (torchao), or back to bf16 / fp32
    nvfp4_emulated.py    NVFP4 training numerics through torchao's NVFP4 tensor (no Blackwell kernels needed)
    blockwise_emulated.py  DeepSeek-V3's 1x128 / 128x128 FP8 tiles through torchao.float8's cast
    keep_fp32.py         ``keep_fp32(model, names)``: modules that run in float32 under autocast

planning/ (which layer gets which), rewrite/ (fix's FP32 islands) and runtime/ (recipe statistics and fallback
during training) all build on it; it imports only the ground floor.
"""
