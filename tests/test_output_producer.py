"""ampaudit/runtime/output_producer.py through the watch: the ``output_logit`` / ``output_lse`` events name the module
that made the model's output (``producer``), also when the root casts, caps or reshapes it on the way out and when
no_grad leaves only the tensor's identity; a product the root computes itself (a tied head) and a module that only
passes its input on (nn.Identity) are not named. The report then says what to do to that module, and the code it
prints runs on it."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import ampaudit
from ampaudit.report.trace_summary import summarize


class LM(nn.Module):
    def __init__(self, post: str | None = None):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.lm_head = nn.Linear(16, 50)
        self.out = nn.Identity()        # returns the head's logits as they are: it made nothing
        self.post = post

    def forward(self, x):
        y = self.out(self.lm_head(self.blocks(self.emb(x))))
        if self.post == "float":
            y = y.float()
        elif self.post == "cap":
            y = 30 * torch.tanh(y / 30)
        elif self.post == "view":
            y = y.view(-1, 50)
        return y


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.ln = nn.Embedding(50, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(self.emb(x)) @ self.emb.weight.T     # the root's own product: no module made the logits


def _output_events(model: nn.Module, *, grad: bool = True, autocast: bool = True) -> list[dict]:
    x = torch.randint(0, 50, (2, 6))
    with ampaudit.watch(model, every=1, stats_every=1, dtype=torch.bfloat16) as w:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        if grad:
            out.float().sum().backward()
    return [e for e in w.events if e["event"] == "precursor" and e["signal"] in ("output_logit", "output_lse")]


@pytest.mark.parametrize("post", [None, "float", "cap", "view"])
def test_output_events_name_the_module_that_made_the_logits(post):
    torch.manual_seed(0)
    events = _output_events(LM(post))
    assert {e["signal"] for e in events} == {"output_logit", "output_lse"}
    assert all(e["module"] == "" and e["producer"] == "lm_head" for e in events), events


def test_without_autograd_the_same_tensor_still_names_it():
    torch.manual_seed(0)
    assert {e.get("producer") for e in _output_events(LM(), grad=False)} == {"lm_head"}
    # fp32 .float() returns the tensor itself; a cap without autograd leaves nothing to follow back
    assert {e.get("producer") for e in _output_events(LM("float"), grad=False, autocast=False)} == {"lm_head"}
    assert {e.get("producer") for e in _output_events(LM("cap"), grad=False)} == {None}


def test_a_product_the_root_computes_itself_names_no_module():
    torch.manual_seed(0)
    events = _output_events(TiedLM())
    assert events and all("producer" not in e for e in events), events


def test_the_report_tells_what_to_do_to_that_module_and_its_code_runs(tmp_path):
    torch.manual_seed(0)
    model, x = LM(), torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        model.lm_head.weight.mul_(300.0)         # logits far past bf16's 64: the signal crosses its line
    trace = tmp_path / "run.jsonl"
    with ampaudit.watch(model, trace, every=1, stats_every=1, dtype=torch.bfloat16) as w:
        for step in range(2):
            w.set_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x).float().sum().backward()
    from ampaudit.runtime.trace import read_trace

    summary = summarize(read_trace(trace)[0])
    rows = [r for r in summary["precursors"]["signals"] if r["signal"] == "output_logit"]
    assert rows and rows[0]["producer"] == "lm_head" and rows[0]["crossed_step"] is not None
    rec = next(r for r in summary["recommendations"] if r["kind"] == "precursor" and r["signal"] == "output_logit")
    assert rec["modules"] == ["lm_head"], rec
    msg = rec["message"]
    assert "of lm_head's output (the model's output) crossed" in msg, msg
    assert "z-loss on lm_head's logits" in msg and "soft-capping on lm_head's output" in msg, msg
    code = re.search(r"ampaudit\.keep_fp32\(model, \[[^\]]*\]\)", msg).group(0)
    eval(code, {"ampaudit": ampaudit, "model": model})             # noqa: S307  the report's own code, as printed
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32                      # the logits now come out of lm_head in fp32
