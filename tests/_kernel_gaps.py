"""A CPU without float16 LSTM kernels, on any CPU: for the tests of what ampaudit says about such a machine.

    with no_fp16_lstm():
        ampaudit.check(model, x, device="cpu", calibrate=True)   # mkldnn_rnn_layer raises as oneDNN does there

The mode sits where oneDNN does, below autocast and the simulation: an fp16 mkldnn_rnn_layer (or its backward)
raises oneDNN's own words, an fp32 one runs, so ampaudit's handling (the CUDA simulation's fp32 fallback, the
machine note, train's hint) is exercised exactly as on an AMD EPYC without native fp16.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torch

_OPS = {"mkldnn_rnn_layer": "forward", "mkldnn_rnn_layer_backward": "backward"}
MESSAGE = ("could not create a primitive descriptor for the LSTM {} propagation primitive. Run workload with "
           "environment variable ONEDNN_VERBOSE=all to get additional diagnostic information.")


class no_fp16_lstm(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase = _OPS.get(func.overloadpacket.__name__)
        if phase and any(isinstance(t, torch.Tensor) and t.dtype == torch.float16 for t in tree_leaves((args, kwargs))):
            raise RuntimeError(MESSAGE.format(phase))
        return func(*args, **kwargs)
