"""ampaudit/runtime/precursors.py: the largest attention logit where sdpa never materializes it (against the
materialized softmax input), attribution to the module whose own code calls softmax / sdpa, the functions restored
after each pass, and the watch's ``precursor`` events."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampaudit
from ampaudit.policy import precursors as precursor_policy
from ampaudit.runtime.precursors import is_attention_scores, logit_limit, mha_max_logit, sdpa_max_logit


def _materialized(q, k, mask=None, *, causal=False, scale=None):
    logits = (q.double() @ k.double().transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        logits = logits.masked_fill(~keep, -math.inf)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    return logits.amax().item()


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "scale", "rectangular_causal"])
def test_sdpa_max_logit_matches_the_materialized_logits(case):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 37, 16, generator=g) * 3, torch.randn(2, 3, 37, 16, generator=g) * 3
    kw, mask = {}, None
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool_mask":
        mask = torch.rand(2, 1, 37, 37, generator=g) > 0.5
        mask[..., 0] = True                              # every row keeps one key
    elif case == "float_mask":
        mask = torch.randn(37, 37, generator=g) * 5
    elif case == "scale":
        kw["scale"] = 0.7
    else:
        q = q[..., :11, :]                               # fewer queries than keys: the top-left causal diagonal
        kw["is_causal"] = True
    want = _materialized(q, k, mask, causal=kw.get("is_causal", False), scale=kw.get("scale"))
    # Chunks of 3 query rows: the chunked path, against the whole product.
    got = sdpa_max_logit(q, k, mask, chunk_elements=3 * 6 * 37, **kw).item()
    assert got == pytest.approx(want, rel=1e-5)
    assert sdpa_max_logit(q, k, mask, **kw).item() == pytest.approx(want, rel=1e-5)


def test_sdpa_max_logit_with_grouped_query_heads_and_bf16_inputs():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    want = _materialized(q, k.repeat_interleave(2, dim=1))
    assert sdpa_max_logit(q, k, enable_gqa=True).item() == pytest.approx(want, rel=1e-5)
    qb, kb = q.bfloat16(), k.bfloat16().repeat_interleave(2, dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # computed in FP32 whatever autocast says
        got = sdpa_max_logit(qb, kb)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(_materialized(qb.float(), kb.float()), rel=1e-5)


def test_mha_max_logit_matches_multihead_attentions_own_weights():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 7, 16) * 2
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True                                    # nn.MultiheadAttention: True = do not attend
    q, k, _ = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
    q, k = (t.reshape(2, 7, 4, 4).transpose(1, 2) for t in (q, k))
    want = _materialized(q, k, ~pad[:, None, None, :])
    seen = {}

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.multi_head_attention_forward:
                seen["v"] = mha_max_logit(args, kwargs or {}).item()
            return func(*args, **(kwargs or {}))

    with Spy():
        mha(x, x, x, key_padding_mask=pad, need_weights=False)
    assert seen["v"] == pytest.approx(want, rel=1e-5)


def test_attention_scores_are_told_from_other_softmax_inputs():
    assert is_attention_scores(torch.zeros(2, 4, 8, 8)) and is_attention_scores(torch.zeros(8, 5, 5))
    assert not is_attention_scores(torch.zeros(8, 16))            # a classifier / router over experts
    assert not is_attention_scores(torch.zeros(2, 10, 8))         # [batch, tokens, experts]
    assert logit_limit("bfloat16") == 64 and logit_limit(torch.float16) == 512


class Handwritten(nn.Module):
    """Materialized attention with an additive -1e9 mask: the mask must not count as a logit."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, _ = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * 8 ** -0.5
        mask = torch.ones(x.shape[1], x.shape[1]).tril()
        self.seen = scores.detach().amax().item()
        return F.softmax(scores + (1 - mask) * -1e9, dim=-1).sum((1, 3))


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        self.seen = _materialized(q.detach(), k.detach(), causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hand, self.fused = Handwritten(), Fused()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.router = nn.Linear(16, 4)
        self.head = nn.Linear(16, 40)

    def forward(self, x):
        h = self.fused(x) + self.hand(x).unsqueeze(-1)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        gate = F.softmax(self.router(h), dim=-1)        # [batch, tokens, experts]: not attention
        return self.head(h * gate.sum(-1, keepdim=True))


def test_watch_attributes_each_logit_to_the_module_whose_code_makes_it():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 6, 16)
    ref = model(x).detach()
    with ampaudit.watch(model, every=1, stats_every=1, dtype=torch.bfloat16) as w:
        out = model(x)
        out.sum().backward()
    assert torch.equal(out.detach(), ref)                 # measuring changes nothing
    events = [e for e in w.events if e["event"] == "precursor"]
    attn = {e["module"]: e for e in events if e["signal"] == "attn_logit"}
    assert set(attn) == {"hand", "fused", "mha"}
    assert attn["hand"]["value"] == pytest.approx(model.hand.seen, rel=1e-5)
    assert attn["fused"]["value"] == pytest.approx(model.fused.seen, rel=1e-5)
    assert attn["hand"]["threshold"] == 100 and attn["hand"]["crossed_step"] is None
    out_ev = {e["signal"]: e for e in events if e["module"] == ""}
    top = max(ref.max().item(), -ref.amax(-1).min().item())   # the largest |row max|: every row is sampled
    assert out_ev["output_logit"]["value"] == pytest.approx(top, rel=1e-6)
    assert out_ev["output_lse"]["value"] == pytest.approx(torch.logsumexp(ref, -1).mean().item(), rel=1e-5)
    _restored()


class Logits(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, x):
        return self.logits + 0 * x


def _output_logit(logits: torch.Tensor) -> dict:
    model = Logits(logits)
    with ampaudit.watch(model, every=1, stats_every=1, dtype=torch.bfloat16) as w:
        model(torch.zeros(())).sum().backward()
    return next(e for e in w.events if e["event"] == "precursor" and e["signal"] == "output_logit")


def test_far_negative_logits_of_unlikely_tokens_are_not_output_logit_growth():
    # An LM's never-seen tokens are pushed far below 0 (-300 here) while each row's top logits stay near 0: those
    # tokens have ~0 probability whatever bf16 spaces them, so nothing needs resolving there. max |logit| read 300.
    torch.manual_seed(0)
    logits = torch.randn(8, 64)
    logits[:, 50:] = -300.0
    ev = _output_logit(logits)
    assert ev["value"] == pytest.approx(logits.max().item(), rel=1e-6) and ev["value"] < 5
    assert ev["crossed_step"] is None


def test_rows_shifted_far_below_zero_are_output_logit_growth():
    # Every logit of a row near -100: its top logits are spaced 0.5 nats apart in bf16, the probabilities coarse.
    torch.manual_seed(0)
    logits = torch.randn(8, 64)
    logits[3] -= 100.0
    ev = _output_logit(logits)
    assert ev["value"] == pytest.approx(-logits[3].max().item(), rel=1e-6) and ev["value"] > 95
    assert ev["crossed_step"] is not None


def _restored():
    from ampaudit.runtime.precursors import PATCHED

    assert "softmax" not in torch.Tensor.__dict__              # the wrapper shadowed TensorBase's method only
    assert F.softmax.__module__ == "torch.nn.functional" and not hasattr(F.softmax, "__wrapped__")
    for owner, name, _ in PATCHED:
        assert not hasattr(getattr(owner, name), "__wrapped__"), name


def test_a_forward_that_raises_leaves_no_mode_behind():
    class Boom(nn.Module):
        def forward(self, x):
            F.softmax(x, -1)
            raise ValueError("boom")

    w = ampaudit.watch(Boom(), stats_every=1)
    with pytest.raises(ValueError):
        w.model(torch.randn(2, 3, 4, 4))
    w.close()
    _restored()


def test_massive_activation_ratio_and_quiet_modules():
    class Spiky(nn.Module):
        def forward(self, x):
            x = x.clone()
            x[0, 0, 0] = 5000.0                               # one value ~5000x the median |x|
            return x

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.spiky, self.calm = Spiky(), nn.Identity()

        def forward(self, x):
            return self.spiky(x)[..., :8] * 0 + self.calm(x)[..., :8]

    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))
    with ampaudit.watch(Net2(), every=1, stats_every=1) as w:
        w.model(x)
    massive = {e["module"]: e for e in w.events if e["event"] == "precursor" and e["signal"] == "massive_activation"}
    assert set(massive) == {"spiky"}                          # |x| below record_abs (10) writes nothing
    y = x.clone()
    y[0, 0, 0] = 5000.0
    k = precursor_policy()["massive_activation"]["sample"]
    median = y.abs().reshape(-1)[:: y.numel() // k][:k].median().item()     # the strided sample
    assert massive["spiky"]["absmax"] == 5000.0 and massive["spiky"]["value"] == pytest.approx(5000.0 / median)


def test_precursors_off():
    with ampaudit.watch(Net(), every=1, stats_every=1, precursors=False) as w:
        w.model(torch.randn(2, 6, 16))
    assert not [e for e in w.events if e["event"] == "precursor"]


def test_massive_activation_samples_outputs_as_they_were_and_batches_mixed_lengths():
    # Medians are taken at the interval's end, batched by sample length and dtype: each must still be that of the
    # output when its module returned it (changed in place afterwards here) and of its own length.
    class Spiky(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.n = n

        def forward(self, x):
            y = x.reshape(-1)[: self.n].clone()
            y[0] = 5000.0
            return y

    class Net3(nn.Module):
        def __init__(self):
            super().__init__()
            self.big, self.small, self.low = Spiky(8192), Spiky(100), Spiky(8192)

        def forward(self, x):
            a, b, c = self.big(x), self.small(x), self.low(x.bfloat16())
            total = a[:4].sum() + b[:4].sum() + c[:4].float().sum()
            a.mul_(0)
            b.mul_(0)
            c.mul_(0)                                         # after the hooks: the samples must not see it
            return total.reshape(1)

    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ampaudit.watch(Net3(), every=1, stats_every=1) as w:
        w.model(x)
    massive = {e["module"]: e for e in w.events if e["event"] == "precursor" and e["signal"] == "massive_activation"}
    assert {"big", "small", "low"} <= set(massive)
    for name, n, dtype in (("big", 8192, torch.float32), ("small", 100, torch.float32), ("low", 8192, torch.bfloat16)):
        y = x.to(dtype).reshape(-1)[:n].clone()
        y[0] = 5000.0
        k = precursor_policy()["massive_activation"]["sample"]
        median = y.abs()[:: max(1, n // k)][:k].float().median().item()
        assert massive[name]["median"] == median and massive[name]["absmax"] == y.abs().max().item()


class _Scores(nn.Module):
    """Attention scores softmaxed by a helper method, a closure and a module-level function: all its own code."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def _attend(self, s):
        return F.softmax(s, dim=-1)

    def forward(self, x):
        s = self.proj(x).reshape(2, 1, 4, 8) @ self.proj(x).reshape(2, 1, 8, 4)

        def closure():
            return self._attend(s) + _module_level_softmax(s * 2)
        return closure().sum(-1)


def _module_level_softmax(s):
    return torch.softmax(s, -1)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Scores()
        self.head = nn.Linear(4, 40)

    def forward(self, x):
        # The child's forward called directly, without nn.Module.__call__ (no module hook would see it run).
        return self.head(self.inner.forward(x))


def test_a_call_is_charged_to_the_innermost_module_on_the_call_stack():
    torch.manual_seed(0)
    model, x = _Outer(), torch.randn(2, 4, 8)
    with ampaudit.watch(model, every=1, stats_every=1, dtype=torch.bfloat16) as w:
        model(x).sum().backward()
    attn = {e["module"]: e for e in w.events if e["event"] == "precursor" and e["signal"] == "attn_logit"}
    s = model.inner.proj(x).reshape(2, 1, 4, 8) @ model.inner.proj(x).reshape(2, 1, 8, 4)
    assert set(attn) == {"inner"}
    assert attn["inner"]["value"] == pytest.approx((s * 2).amax().item(), rel=1e-5)   # the larger of its two calls
    _restored()


def test_precursors_run_on_their_own_passes_between_the_sampled_ones(tmp_path):
    torch.manual_seed(0)
    model, x = _Outer(), torch.randn(2, 4, 8)
    trace = tmp_path / "run.jsonl"
    with ampaudit.watch(model, trace, every=100, stats_every=8, precursors_every=3, locate_first=False) as w:
        for step in range(10):
            w.set_step(step)
            model(x).sum().backward()
    meta, *events = [json.loads(line) for line in trace.read_text().splitlines()]
    attn = [e for e in events if e["event"] == "precursor" and e["signal"] == "attn_logit"]
    stats = [e for e in events if e["event"] == "stats" and e["module"] == "head" and e["phase"] == "forward"]
    # Sampled passes 0 and 8 (statistics and precursors), precursor passes 3, 6 and 9 between them.
    assert [e["passes"] for e in attn] == [5] and [e["passes"] for e in stats] == [2]
    assert (meta["stats_every"], meta["precursors_every"]) == (8, 3)
    with pytest.raises(ampaudit.AmpAuditError, match="precursors_every"):
        ampaudit.watch(nn.Linear(2, 2), precursors_every=0)
