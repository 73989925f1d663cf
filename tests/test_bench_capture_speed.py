"""bench/capture_speed.py's tables and its findings comparison (no model zoo needed)."""
from __future__ import annotations

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import capture_speed as cs  # noqa: E402

FINDING = {"rule": "AMP201", "module": "head", "file": "m.py", "line": 3, "severity": "warning", "message": "m"}


def _row(model, capture, check, base, family="torchvision-det"):
    return {"family": family, "model": model, "capture": capture, "check_s": check, "baseline_s": base,
            "ratio": check / base, "findings": [FINDING]}


def test_family_table_gives_median_worst_and_ratio_per_capture():
    rows = [_row("a", "dispatch", 2.0, 1.0), _row("b", "dispatch", 4.0, 1.0), _row("c", "dispatch", 3.0, 2.0),
            _row("t5", "export", 1.2, 1.0, family="transformers"), {"family": "timm", "model": "x", "error": "e"}]
    table = cs.family_table(rows)
    det = next(line for line in table if line.startswith("| torchvision-det"))
    assert "| 3 | 3.00 s | 4.00 s (b) | 2.00x | 4.00x | eager |" in det
    hf = next(line for line in table if line.startswith("| transformers"))
    assert "| export | 1 | 1.20 s |" in hf and hf.endswith("| export |")
    assert not any("timm" in line for line in table)     # a model that failed has no time to show


def test_compare_names_models_whose_findings_changed(tmp_path):
    before = tmp_path / "before.json"
    before.write_text(json.dumps([{"family": "torchvision-det", "model": "a", "findings": [FINDING]},
                                  {"family": "torchvision-det", "model": "b", "findings": [FINDING]}]))
    same, changed = _row("a", "dispatch", 1, 1), _row("b", "dispatch", 1, 1)
    changed["findings"] = []
    diffs = cs.compare([same, changed], before)
    assert len(diffs) == 1 and diffs[0].startswith("b: 1 finding(s) lost, 0 gained")
    assert cs.compare([same], before) == []
