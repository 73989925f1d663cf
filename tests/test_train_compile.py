"""``compile=True``: the sample transformer trains to eager's loss; the watch sees the eager steps only."""
import pytest
import torch
from conftest import ROOT, load_module

from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer

SAMPLE = ROOT / "samples" / "char_transformer.py"


def _train(sample, tmp_path, **kwargs):
    model = sample.build_model()
    trainer = Trainer(model, sample.loss_fn, sample.train_data, dtype="float16", handle_signals=False,
                      trace_every=3, **kwargs)
    return trainer, trainer.fit(steps=6)


@pytest.mark.slow
def test_compiled_training_matches_eager_and_the_watch_sees_only_eager_steps(tmp_path):
    torch._dynamo.reset()
    sample = load_module(SAMPLE)
    _, eager = _train(sample, tmp_path)
    trace = tmp_path / "run.jsonl"
    trainer, compiled = _train(sample, tmp_path, compile=True, trace=trace)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-2)
    assert compiled.scale == eager.scale and compiled.skipped == eager.skipped == 0
    events, problems = read_trace(trace)
    assert not problems and events[0]["compile"] is True
    root = [e for e in events if e["event"] == "stats" and e["module"] == "" and e["phase"] == "forward"]
    # Steps 1, 3 and 6 ran eagerly with the watch's hooks; the compiled graph of the others traced none.
    assert sum(e["passes"] for e in root) == 3
