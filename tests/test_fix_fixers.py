"""The rule names its fix: autofix = {kind, safety} in its TOML entry, a fixer registered per kind."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.errors import RuleError
from ampaudit.rewrite import fixers
from ampaudit.rewrite.fixers import FIXERS, fixer
from ampaudit.rules.loader import load_rules


def test_the_declared_fix_kinds_are_the_registered_ones():
    """rules/policy/fixes.toml (what the loader checks rule files against) names exactly the registered fixers."""
    from ampaudit.rules.schema import fix_kinds
    from ampaudit.sourcefix.registry import load_builtin_fixers

    assert set(fix_kinds()["autofix"]) == set(FIXERS)
    assert set(fix_kinds()["source_fix"]) == set(load_builtin_fixers())


def test_every_builtin_rule_names_a_registered_fixer_or_none():
    for rule in load_rules():
        assert rule.autofix["kind"] in set(FIXERS) | {"none"}, rule.id
        if rule.autofix["kind"] != "none":
            assert rule.autofix["safety"] in ("safe", "unsafe"), rule.id


def _rule_file(tmp_path, autofix: str):
    (tmp_path / "mine.toml").write_text(f'''
[[rule]]
id = "X900"
name = "every-linear"
family = "sensitive-op"
severity = "warning"
matcher = "reduced_precision_op"
ops = ["linear"]
autofix = {autofix}
message = "{{op}} runs in {{compute_dtype}}"
why = "a test rule"
''')
    return tmp_path


def test_a_new_fix_kind_is_one_registered_function(tmp_path, monkeypatch):
    from ampaudit.rules import schema

    seen = []
    kinds = schema.fix_kinds()
    monkeypatch.setattr(schema, "fix_kinds", lambda: {**kinds, "autofix": {**kinds["autofix"], "count": frozenset()}})
    monkeypatch.setitem(FIXERS, "count", fixers.Fixer("count", lambda job: seen.extend(
        f.rule for f in fixers.of_kind(job.findings, "count")) or [], None))
    rules = _rule_file(tmp_path, '{kind = "count", safety = "safe"}')
    ampaudit.fix(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), device="cuda", rules_dirs=[rules],
                 select=["X900"], verify=False)
    assert seen == ["X900"]


def test_an_unknown_fix_kind_is_a_rule_error(tmp_path):
    rules = _rule_file(tmp_path, '{kind = "rewrite-everything", safety = "safe"}')
    with pytest.raises(RuleError, match="rewrite-everything"):
        ampaudit.fix(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8), device="cuda", rules_dirs=[rules],
                     select=["X900"], verify=False)


@pytest.mark.parametrize("autofix, needs", [('{safety = "safe"}', "needs a kind"), ('{kind = "island"}', "needs safety")])
def test_a_malformed_autofix_names_the_rule_and_key(tmp_path, autofix, needs):
    with pytest.raises(RuleError, match=f"X900: key 'autofix' {needs}"):
        load_rules([_rule_file(tmp_path, autofix)])


def test_fixer_registration_warns_on_a_duplicate(monkeypatch):
    monkeypatch.setattr(fixers, "FIXERS", FIXERS.copy())
    with pytest.warns(UserWarning, match="registered twice"):
        fixer("island")(lambda job: [])
