"""Op tables the rewrite passes read: which nodes are cheap enough to join an FP32 island, which consume a mask
constant, which must never move or be merged across. Plain data, keyed by the canonical op names of
``rules/policy/ops.toml`` (``node.meta["amp"].op``) or, for in-place and random ops, by the raw target name.

    from ampaudit.rewrite.op_sets import CHEAP, MASK_CONSUMERS
"""
from __future__ import annotations

# Elementwise ops: one output element from the same element of each input, so running them in fp32 costs
# bandwidth only. They join an island when they sit between two flagged nodes.
ELEMENTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "relu", "gelu", "silu", "tanh", "sigmoid", "where",
    "masked_fill", "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "square", "sqrt", "erf",
    "leaky_relu", "elu", "hardtanh", "relu6", "softsign", "mish", "hardswish", "hardsigmoid", "sign", "floor",
    "ceil", "round", "trunc", "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "lerp", "addcmul", "addcdiv",
    "identity", "sin", "cos",
})

# Data movement without arithmetic: views, slices, concatenation.
VIEWS = frozenset({
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous",
    "expand", "expand_as", "getitem", "chunk", "split", "narrow", "t", "select", "movedim", "view_as",
    "repeat", "tile", "cat", "stack", "clone", "detach", "tril", "triu",
})

CHEAP = ELEMENTWISE | VIEWS

# Ops that turn a mask constant's -inf into NaN, or read it as "masked": the forward walk from a constant
# finding pulls the ops in between and the first of these into the island, so -inf never exists in fp16.
MASK_CONSUMERS = frozenset({"softmax", "log_softmax", "softmin", "logsumexp", "scaled_dot_product_attention"})

# Elementwise ops the constant walk follows (the mask is added, scaled, filled or selected on its way).
MASK_CARRIERS = frozenset({"add", "sub", "rsub", "mul", "div", "where", "masked_fill", "neg", "clamp",
                           "clamp_min", "clamp_max", "maximum", "minimum"}) | VIEWS

# Random ops draw from the generator in program order: moving one changes which numbers every later one gets.
RANDOM = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rand",
    "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli", "multinomial",
    "normal", "poisson", "uniform_", "normal_", "bernoulli_", "exponential_",
})

# Module classes that are random in training mode.
RANDOM_MODULES = frozenset({"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                            "FeatureAlphaDropout"})

# In-place Python operators (x += y): fx records them as these functions.
INPLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                               "ixor", "ilshift", "irshift", "imatmul", "setitem"})
