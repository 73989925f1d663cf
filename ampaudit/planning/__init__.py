"""Per-layer precision plans: which nn.Linear trains in float8, which in bf16, which stays fp32.

    measure.py   each Linear alone on the inputs and gradients it really gets, in fp8 (torchao), bf16, fp16
    fp8.py       torchao, imported quietly; its recipes; what a cast to fp8 flushes, clips, keeps
    speed.py     a roofline of each Linear's GEMMs in bf16 and fp8 on a named GPU (rules/policy/gpus.toml)
    choose.py    the decision and its reasons
    api.py       ``ampaudit.plan(model, batches, ...)`` -> Plan, and its JSON contract
    apply.py     a plan applied to a model for training (``ampaudit train --plan``)
    convert.py   one Linear in any recipe of rules/policy/recipes.toml through torchao, switched in place
    nvfp4_emulated.py   NVFP4's GEMM numerics through torchao's NVFP4Tensor where its training config refuses
    blockwise_emulated.py   DeepSeek-V3's blockwise FP8 GEMMs through torchao.float8's cast, per tile
    report.py    the terminal table
"""
