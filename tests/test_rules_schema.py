"""A rule file is checked completely at load: each kind of typo is one error line naming the file, rule and key
(``ampaudit check --rules DIR`` exits 2 with it), before any model is captured."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import ampaudit
import ampaudit.cli.commands  # noqa: F401  (registers the commands)
from ampaudit.cli.app import app
from ampaudit.errors import RuleError
from ampaudit.rules.loader import find_rule, load_rules, rule_selected, validate_selectors
from conftest import ROOT

GOOD = {"id": '"X900"', "name": '"my-exp"', "family": '"sensitive-op"', "severity": '"warning"',
        "matcher": '"reduced_precision_op"', "ops": '["exp"]', "message": '"{op} computes in {compute_dtype}"',
        "why": '"a test rule"', "autofix": '{kind = "island", safety = "safe"}'}


def _write(tmp_path, extra: str = "", **over) -> str:
    keys = {**GOOD, **over}
    body = "\n".join(f"{k} = {v}" for k, v in keys.items() if v is not None)
    (tmp_path / "mine.toml").write_text(f"[[rule]]\n{body}\n{extra}")
    return str(tmp_path)


# (the rule file's changes, what the one error line must name)
TYPOS = {
    "check value": (dict(matcher='"calibrated_range"', check='"overflw"', message='"{absmax}"', ops=None),
                    "key 'check' is 'overflw'"),
    "unknown variant": (dict(extra='[rule.variants.acumulates]\nseverity = "info"\n'),
                        "variant 'acumulates': matcher reduced_precision_op names no such variant"),
    "unknown fix kind": (dict(autofix='{kind = "islnd", safety = "safe"}'), "key 'autofix.kind' is 'islnd'"),
    "unknown source fix kind": (dict(source_fix='{kind = "upcast", safety = "safe"}'),
                                "key 'source_fix.kind' is 'upcast'"),
    "unknown fixer parameter": (dict(source_fix='{kind = "upcast_op", safety = "safe", cast_bak = true}'),
                                "key 'source_fix.cast_bak' is not a parameter of edit kind 'upcast_op'"),
    "graph fixer parameter": (dict(autofix='{kind = "pad", safety = "safe", layer = "linear"}'),
                              "key 'autofix.layer' is not a parameter of fix kind 'pad'"),
    "unknown matcher": (dict(matcher='"reduced_precision"'), "key 'matcher' names unknown matcher"),
    "unknown parameter": (dict(upcast_severty='"info"'), "unknown key 'upcast_severty'"),
    "unknown field": (dict(message='"{op} in {compute_dtyp}"'), "key 'message' uses unknown field(s) ['compute_dtyp']"),
    "format spec on an unknown value": (dict(message='"{op} over {depth:d} elements"'),
                                        "key 'message' formats {depth:d}, a field matcher reduced_precision_op may "
                                        "leave unknown"),
    "parameter type": (dict(ops='"exp"'), "key 'ops' is 'exp', not a list of op names"),
    "integer parameter": (dict(min_depth='"4096"'), "key 'min_depth' is '4096', not an int"),
    "conversion": (dict(message='"{op!x}"'), "key 'message' converts {op!x}"),
    "unknown op set": (dict(ops='["@my_ops"]'), "key 'ops' names unknown op set '@my_ops'"),
    "missing matcher parameter": (dict(matcher='"constants"', ops=None, message='"{value}"'),
                                  "missing key 'default_params', a parameter matcher constants needs"),
}


@pytest.mark.parametrize("kind", sorted(TYPOS))
def test_each_kind_of_typo_is_refused_at_load_with_one_line(tmp_path, kind):
    over, says = TYPOS[kind]
    folder = _write(tmp_path, **over)
    with pytest.raises(RuleError) as exc:
        load_rules([folder])
    line = exc.value.one_line()
    assert "\n" not in line and line.startswith("mine.toml: rule X900: ") and says in line, line


@pytest.mark.parametrize("kind", sorted(TYPOS))
def test_check_with_a_bad_rule_folder_exits_2_with_one_line(tmp_path, kind):
    over, says = TYPOS[kind]
    folder = _write(tmp_path, **over)
    r = CliRunner().invoke(app, ["check", str(ROOT / "samples" / "clean_mlp.py"), "--rules", folder])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: mine.toml: rule X900: ") and says in lines[0], r.stderr


def test_a_good_rule_file_loads_and_its_check_param_is_validated_only_for_its_matcher(tmp_path):
    (rule,) = [r for r in load_rules([_write(tmp_path)]) if r.id == "X900"]
    assert rule.param("ops") == ["exp"]


def test_lowercase_ids_and_names_select_in_any_case(tmp_path):
    rules = load_rules([_write(tmp_path, id='"my901"')])
    mine = find_rule(rules, "MY901")
    assert mine.id == "my901" and find_rule(rules, "amp201").id == "AMP201"
    for sel in ("my901", "MY901", "My9", "MY-EXP", "sensitive-op"):
        validate_selectors(rules, [sel], "--select")
        assert rule_selected(mine, [sel], None), sel
    assert not rule_selected(mine, ["my901"], ["MY901"])
    assert rule_selected(find_rule(rules, "AMP201"), ["amp2"], None)
    with pytest.raises(RuleError, match="already defined"):
        load_rules([_write(tmp_path, id='"amp201"', name='"other"')])


class _ExpOfLinear(nn.Module):
    """exp (and log1p) of a Linear's output: low precision under CPU autocast."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return torch.exp(y).sum() + torch.log1p(y.abs()).sum()


def _check(model, **kw):
    return ampaudit.check(model, torch.randn(2, 8), device="cpu", **kw)


def test_lowercase_select_runs_the_rule_through_check(tmp_path):
    report = _check(_ExpOfLinear(), dtype="bfloat16", rules_dirs=[_write(tmp_path, id='"my901"')], select=["my901"])
    assert {f.rule for f in report.findings} == {"my901"}
    lower = _check(_ExpOfLinear(), dtype="bfloat16", select=["amp202"])
    assert {f.rule for f in lower.findings} == {"AMP202"}


def test_a_rules_folder_adds_an_op_set_its_rules_name(tmp_path):
    """[op_sets] in a --rules file: a named op list its rules can use (``ops = ["@my_ops"]``)."""
    folder = _write(tmp_path, ops='["@my_ops", "@my_ops", "exp"]', extra="\n[op_sets]\nmy_ops = [\"log1p\"]\n")
    (rule,) = [r for r in load_rules([folder]) if r.id == "X900"]
    assert rule.param("ops") == ["log1p", "exp"]
    report = _check(_ExpOfLinear(), dtype="bfloat16", rules_dirs=[folder], select=["X900"])
    assert sorted(f.op for f in report.findings) == ["exp", "log1p"]


def test_an_op_set_defined_twice_is_an_error(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / f"{d.name}.toml").write_text('[op_sets]\nmine = ["exp"]\n')
    with pytest.raises(RuleError, match="op set 'mine' already defined in a.toml"):
        load_rules([a, b])


def test_shared_params_apply_to_the_files_rules_of_that_matcher(tmp_path):
    folder = _write(tmp_path, ops=None, extra='\n[params.reduced_precision_op]\nops = ["exp"]\n')
    (rule,) = [r for r in load_rules([folder]) if r.id == "X900"]
    assert rule.param("ops") == ["exp"]
    (tmp_path / "mine.toml").write_text((tmp_path / "mine.toml").read_text() + 'opz = ["exp"]\n')
    with pytest.raises(RuleError, match=r"\[params.reduced_precision_op\]: unknown key 'opz'"):
        load_rules([folder])


def test_no_message_text_hard_codes_a_dtype_limit():
    """Messages read limits from the dtype ({max}, {max_sqrt}, ...): fp16's 65504 appears in no rule's texts."""
    for rule in load_rules():
        texts = [rule.message, rule.why, rule.fix or ""]
        texts += [v.get(k, "") for v in rule.param("variants", {}).values() for k in ("message", "why", "fix")]
        assert not any("65504" in t for t in texts), rule.id


def test_limits_in_texts_follow_the_target_dtype():
    (exp, log1p) = _check(_ExpOfLinear(), dtype="float16", select=["AMP202"]).findings
    assert "whose largest value is 65504: exp overflows for inputs above 11.1, x**3 for |x| above 40, 1/x for " \
           "inputs below 1.5e-05" in exp.why, exp.why
    assert "float16" in log1p.why


def test_the_readme_rule_example_loads(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("### Rules are data", 1)[1]
    (tmp_path / "x.toml").write_text(text.split("```toml\n", 1)[1].split("```", 1)[0])
    rule = find_rule(load_rules([tmp_path]), "x100")
    assert rule.param("ops") == ["erf", "erfinv", "lgamma"]


def test_ignore_comments_name_rules_in_any_case():
    from ampaudit.rules.engine import ignores

    assert ignores("x = y  # ampaudit: ignore[amp201]", "AMP201", "softmax-reduced-precision")
    assert ignores("x = y  # ampaudit: ignore[MY901]", "my901", "my-exp")
    assert not ignores("x = y  # ampaudit: ignore[AMP202]", "AMP201", "softmax-reduced-precision")


def test_explain_finds_a_rule_in_any_case_and_says_what_it_checks():
    r = CliRunner().invoke(app, ["rules", "explain", "amp401"])
    assert r.exit_code == 0, r.output
    what = find_rule(load_rules(), "AMP401").params["docs"]["what"]
    assert r.output.startswith("AMP401 ") and "Checks: " + " ".join(what.split()) in r.output


def test_a_message_names_the_rules_own_scalar_parameters(tmp_path):
    """{min_depth} fills from the rule's parameter; a rule that does not set it cannot name it."""
    folder = _write(tmp_path, message='"{op} past {min_depth} terms"', min_depth="7")
    report = _check(_ExpOfLinear(), dtype="bfloat16", rules_dirs=[folder], select=["X900"])
    assert [f.message for f in report.findings] == ["exp past 7 terms"]
    with pytest.raises(RuleError, match=r"unknown field\(s\) \['min_depth'\]"):
        load_rules([_write(tmp_path, message='"{op} past {min_depth} terms"')])


def _fix_commands(text: str) -> list[list[str]]:
    """The options of each ``ampaudit fix`` command in ``text`` ("-o DIR" keeps DIR, a placeholder)."""
    return [m.group(1).split() for m in re.finditer(r"ampaudit fix((?: +-[-\w]+(?: DIR)?)*)", text)]


def test_every_fix_command_a_finding_prints_runs_as_printed():
    """``ampaudit fix`` refuses to run without -o DIR (the graph rewrite) or --diff/--write (the source fix):
    each command in a rule's fix text, and in what replaces it on a model fx cannot trace, names one."""
    import typer.main

    from ampaudit.policy import settings

    options = {o for p in typer.main.get_command(app).commands["fix"].params for o in p.opts}
    texts = [(r.id, t) for r in load_rules() for t in [r.fix or ""]
             + [v.get("fix", "") for v in r.param("variants", {}).values()]]
    texts += [(table, t) for table, phrases in settings()["recommend"].items() if table.startswith("untraceable")
              for t in phrases.values()]
    commands = [(where, c) for where, t in texts for c in _fix_commands(t)]
    assert len(commands) > 10
    for where, command in commands:
        named = [t for t in command if t.startswith("-")]
        assert set(named) <= options, (where, command)
        assert {"-o", "--diff", "--write"} & set(named), (where, command)
    result = CliRunner().invoke(app, ["fix", str(ROOT / "samples" / "clean_mlp.py")])
    assert result.exit_code == 2 and "fix needs --output DIR" in result.output
