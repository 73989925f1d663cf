"""Repeated findings are one row in the terminal, each finding keeps its group id in JSON."""
from __future__ import annotations

import io
import json

import torch
from rich.console import Console
from torch import nn

import ampaudit
from ampaudit.report.console import render_report
from ampaudit.report.groups import group_findings, group_ids, module_pattern


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Deep(nn.Module):
    """Twelve identical blocks in three stages: one BatchNorm finding per block, one row in the table."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(*[Block() for _ in range(4)]) for _ in range(3))

    def forward(self, x):
        for s in self.stages:
            x = s(x)
        return x


def test_module_pattern_globs_what_differs():
    assert module_pattern(["layer1.0.bn1", "layer2.1.bn2"]) == "layer*.*.bn*"
    assert module_pattern(["blocks.0.attn", "blocks.11.attn"]) == "blocks.*.attn"
    assert module_pattern(["bn1", "layer1.0.bn1", "layer1.1.bn1"]) == "bn1, layer1.*.bn1"
    assert module_pattern([""]) == "<top>"
    assert module_pattern(["a"]) == "a"


def test_one_row_per_group_and_every_finding_in_json():
    report = ampaudit.check(Deep(), torch.randn(2, 8, 8, 8), device="cuda")
    bn = [f for f in report.findings if f.rule == "AMP301"]
    assert len(bn) == 12 and {f.severity for f in bn} == {"info"}
    groups = [g for g in group_findings(report.findings) if g.rule == "AMP301"]
    assert len(groups) == 1 and groups[0].count == 12 and groups[0].pattern == "stages.*.*.bn"
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console)
    text = console.file.getvalue()
    assert text.count("AMP301") == 1 and "12x batch_norm" in text      # an info: one line, with its count
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console, verbose=True)
    text = console.file.getvalue()
    assert text.count("AMP301") == 1 and "12x in stages.*.*.bn (12 modules)" in text
    data = report.to_dict()
    assert len(data["findings"]) == len(report.findings)
    ids = [f["group"] for f in data["findings"] if f["rule"] == "AMP301"]
    assert len(set(ids)) == 1
    assert json.loads(json.dumps(data))["version"] == "1.3"


def test_group_ids_number_groups_in_first_occurrence_order():
    report = ampaudit.check(Deep(), torch.randn(2, 8, 8, 8), device="cuda")
    ids = group_ids(report.findings)
    assert ids[0] == 0 and sorted(set(ids)) == list(range(len(group_findings(report.findings))))


def test_findings_that_differ_only_in_numbers_share_a_row():
    # Misaligned GEMMs of one kind and dim, each with its own sizes, are one row per severity; JSON has each.
    model = nn.Sequential(nn.Linear(1000, 500), nn.Linear(500, 250), nn.Linear(250, 10), nn.Linear(10, 6))
    report = ampaudit.check(model, torch.randn(4, 1000), device="cuda")
    groups = [g for g in group_findings(report.findings) if g.rule == "AMP101"]
    keys = [(g.severity, g.message.split(":")[1].split("=")[0].strip()) for g in groups]
    assert len(keys) == len(set(keys))                      # one row per (severity, which dim)
    assert sum(g.count for g in groups) == len([f for f in report.findings if f.rule == "AMP101"]) >= 5
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console)
    assert "more like it" in console.file.getvalue()


def test_group_locations_are_distinct_in_first_seen_order():
    from ampaudit.findings import Finding

    def f(line):
        return Finding(rule="AMP301", name="n", family="normalization", severity="info", module=f"m{line}",
                       op="batch_norm", message="same", location={"file": "net.py", "line": line})

    (g,) = group_findings([f(3), f(1), f(3), f(2)])
    assert [loc["line"] for loc in g.locations] == [3, 1, 2] and g.modules == ["m3", "m1", "m2"]


def test_the_where_columns_plus_n_is_spelled_out():
    from ampaudit.findings import Finding

    findings = [Finding(rule="AMP301", name="batchnorm-fp16", family="normalization", severity="info",
                        module=f"m{i}", op="batch_norm", message="BatchNorm2d under autocast",
                        location={"file": "net.py", "line": 10 + i}) for i in range(6)]
    report = ampaudit.findings.Report(target="net.py", capture="fx", policy={"device": "cuda", "dtype": "float16"},
                                      findings=findings)
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console, verbose=True)       # infos: in full only with verbose
    text = console.file.getvalue()
    assert "net.py:10 +5" in text and "+5 more line(s): net.py:11, net.py:12, net.py:13 and 2 more" in text
