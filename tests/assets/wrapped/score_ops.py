"""The user's own utility module, autowrapped by their tracer."""
import math

import torch


def naive_softmax(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)


def scaled(x):
    return x * (1.0 / math.sqrt(x.shape[-1]))
