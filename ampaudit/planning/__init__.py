"""Per-layer precision plans: which nn.Linear trains in which low-precision recipe, which in bf16, which stays fp32.

    recipes.py   the recipe table (rules/policy/recipes.toml): names, scaling, budgets, fallback; normalise_plan
    measure.py   each Linear alone on the inputs and gradients it really gets, in each recipe, bf16, fp16
    emulate.py   each recipe's Linear as torchao runs it, on CPU, and what its casts do to each operand
    fp8.py       torchao, imported quietly; its float8 recipes; what a cast to fp8 flushes, clips, keeps
    speed.py     a roofline of each Linear's GEMMs in bf16 and low precision on a named GPU (rules/policy/gpus.toml)
    step_model.py  a whole transformer training step under FSDP from its shapes, checked against published runs
    pick.py      the choice among recipes, per layer and per GEMM, and its reasons
    choose.py    the shared pieces of a choice (budget, LayerPlan, alignment, bf16's own check); one-recipe choose()
    api.py       ``ampaudit.plan(model, batches, ...)`` -> Plan, and its JSON contract (version 2)
    apply.py     a plan applied to a model for training (``ampaudit train --plan``)
    convert.py   one Linear in any recipe of rules/policy/recipes.toml through torchao, switched in place
    nvfp4_emulated.py   NVFP4's GEMM numerics through torchao's NVFP4Tensor where its training config refuses
    blockwise_emulated.py   DeepSeek-V3's blockwise FP8 GEMMs through torchao.float8's cast, per tile
    report.py    the terminal table
"""
