"""Per-layer precision plans: which nn.Linear trains in which low-precision recipe, which in bf16, which stays fp32.

    measure.py   each Linear alone on the inputs and gradients it really gets, in each recipe, bf16, fp16
    emulate.py   each recipe's Linear as torchao runs it, on CPU, and what its casts do to each operand
    speed.py     a roofline of each Linear's GEMMs in bf16 and low precision on a named GPU (rules/policy/gpus.toml)
    step_model.py  a whole transformer training step under FSDP from its shapes, checked against published runs
    pick.py      the choice among recipes, per layer and per GEMM, and its reasons
    choose.py    the shared pieces of a choice (budget, LayerPlan, alignment, bf16's own check); one-recipe choose()
    api.py       ``ampaudit.plan(model, batches, ...)`` -> Plan, and its JSON contract (version 2)
    apply.py     a plan applied to a model for training (``ampaudit train --plan``)
    report.py    the terminal table

The recipe table, torchao's conversions and the emulated kernels it builds on are :mod:`ampaudit.precision`.
"""
