"""--pad: misaligned Linear / Embedding / Conv dims grow to the multiple with zeros; outputs do not change,
tied weights stay tied, and checkpoints saved before padding still load."""
from __future__ import annotations

import torch
from conftest import ASSETS, SAMPLES
from torch import nn

from ampaudit.loading import load_target
from ampaudit.rewrite import fix


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= 1e-6 * max(1.0, float(b.abs().max()))


def _fp32(model, args):
    with torch.no_grad():
        return model(*args)


def test_mlp_dims_aligned_and_outputs_kept():
    t = load_target(str(SAMPLES / "misaligned_mlp.py"))
    result = fix(t.model, *t.args, device="cuda", dtype="float16", pad=True)
    m = result.module
    assert [(l.in_features, l.out_features) for l in (m.fc1, m.fc2, m.out)] == [(1000, 504), (504, 256), (256, 16)]
    assert _close(_fp32(m, t.args), _fp32(t.model, t.args))
    assert list(m.state_dict()) == list(t.model.state_dict())
    # fc1 -> relu -> fc2 keeps the padded features (zero columns meet them); only the logits are sliced.
    slices = {c.module: c.slices for c in result.report.padding}
    assert slices == {"fc1": 0, "fc2": 0, "out": 1}
    fc1 = next(c for c in result.report.padding if c.module == "fc1")
    assert (fc1.gemm_before, fc1.gemm_after) == ("M=500 N=100 K=1000", "M=504 N=100 K=1000")
    assert result.report.verification.fp32_ok and not result.report.verification.remaining
    # A checkpoint of the unpadded model loads into the padded one and gives the same outputs.
    m.load_state_dict(t.model.state_dict())
    assert _close(_fp32(m, t.args), _fp32(t.model, t.args))


def test_tied_embedding_and_head_padded_once():
    t = load_target(str(ASSETS / "fix" / "tied_lm.py"))
    result = fix(t.model, *t.args, device="cuda", dtype="float16", pad=True)
    m = result.module
    assert m.head.weight is m.emb.weight and m.emb.weight.shape == (56, 32)
    assert m.emb.num_embeddings == 56 and m.head.out_features == 56
    assert (m.fc.out_features, m.proj.in_features) == (32, 32)
    ref, out = _fp32(t.model, t.args), _fp32(m, t.args)
    assert out.shape == ref.shape == (4, 6, 50) and _close(out, ref)
    assert list(m.state_dict()) == list(t.model.state_dict())


def test_conv_channels_padded():
    t = load_target(str(ASSETS / "fix" / "conv_net.py"))
    result = fix(t.model, *t.args, device="cuda", dtype="float16", pad=True)
    conv = result.module.conv
    assert (conv.in_channels, conv.out_channels) == (8, 16) and conv.weight.shape == (16, 8, 3, 3)
    assert _close(_fp32(result.module, t.args), _fp32(t.model, t.args))


def test_pad_off_changes_no_shape():
    t = load_target(str(SAMPLES / "misaligned_mlp.py"))
    m = fix(t.model, *t.args, device="cuda", verify=False).module
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in t.model.state_dict().items()}
    assert isinstance(m, nn.Module)
