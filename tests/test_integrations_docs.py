"""The rule reference in docs/rules/ is generated from rules/*.toml: these tests fail when they drift apart."""
from __future__ import annotations

import re
import shutil

import pytest

from ampaudit.docs_gen import DOCS_DIR, main, render_pages, stale_pages, write_pages
from ampaudit.errors import RuleError
from ampaudit.rules.loader import load_rules

HEADINGS = ["## What it checks", "## Why it matters", "## Example", "## Fix"]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return render_pages(load_rules())


def test_committed_pages_match_the_rule_files(pages):
    stale = stale_pages(DOCS_DIR, pages)
    assert not stale, f"docs/rules is out of date ({', '.join(stale)}): run python -m ampaudit.docs_gen"


def test_regenerating_into_a_temp_dir_gives_the_committed_files(tmp_path, pages):
    write_pages(tmp_path, pages)
    committed = sorted(p.name for p in DOCS_DIR.glob("*.md"))
    assert sorted(p.name for p in tmp_path.glob("*.md")) == committed
    for name in committed:
        assert (tmp_path / name).read_text() == (DOCS_DIR / name).read_text(), name


def test_every_page_shows_the_rules_source_fix(pages):
    """fix --diff/--write's kind and safety, from the rule's source_fix, in its Fix section."""
    for rule in load_rules():
        sf = rule.params.get("source_fix", {"kind": "none"})
        fix = pages[f"{rule.id}.md"].split("## Fix", 1)[1]
        line = next(ln for ln in fix.splitlines() if ln.startswith("`ampaudit fix --diff` / `--write`: "))
        if sf["kind"] == "none":
            assert line.endswith("reported, not edited."), rule.id
        else:
            assert f"**{sf['kind']}** ({sf['safety']}: " in line, rule.id
    assert "edited only when the rule is named: `--select AMP201`" in pages["AMP201.md"]
    assert "Its info findings are edited too." in pages["AMP103.md"]


def test_every_rule_has_a_page_with_the_fixed_headings(pages):
    rules = load_rules()
    for rule in rules:
        text = pages[f"{rule.id}.md"]
        positions = [text.index(h) for h in HEADINGS]
        assert positions == sorted(positions), rule.id
        assert " ".join(rule.why.split()) in text                      # why, from the rule file itself
        assert "```python" in text.split("## Example")[1]
        assert f"[{rule.id}]({rule.id}.md)" in pages["README.md"]
    assert len(re.findall(r"^\| \[AMP", pages["README.md"], re.M)) == len(rules)


def test_a_changed_rule_makes_the_page_stale(tmp_path, pages):
    write_pages(tmp_path, pages)
    rules = load_rules()
    import dataclasses
    edited = [dataclasses.replace(r, why=r.why + " Also this.") if r.id == "AMP201" else r for r in rules]
    assert stale_pages(tmp_path, render_pages(edited)) == ["AMP201.md"]
    (tmp_path / "AMP999.md").write_text("old rule")
    assert "AMP999.md" in stale_pages(tmp_path, pages)
    write_pages(tmp_path, pages)
    assert not (tmp_path / "AMP999.md").exists()


def test_a_rule_without_docs_is_an_error():
    """Every page comes from the rule's own [rule.docs] table: a rule without one cannot be rendered."""
    import dataclasses

    rules = load_rules()
    bare = [dataclasses.replace(r, params={k: v for k, v in r.params.items() if k != "docs"})
            if r.id == "AMP101" else r for r in rules]
    with pytest.raises(RuleError, match=r"rule AMP101: no \[rule.docs\] table"):
        render_pages(bare)


def test_cli_check_mode(tmp_path, capsys):
    out = tmp_path / "rules"
    shutil.copytree(DOCS_DIR, out)
    assert main(["--check", "--out", str(out)]) == 0
    (out / "AMP301.md").write_text("edited by hand")
    assert main(["--check", "--out", str(out)]) == 1
    assert "AMP301.md" in capsys.readouterr().err
    assert main(["--out", str(out)]) == 0 and main(["--check", "--out", str(out)]) == 0


def test_the_wheel_ships_the_rules_but_not_the_docs_generator():
    # docs_gen writes into the repository's docs/rules, which an installed wheel does not have.
    import tomllib

    from conftest import ROOT

    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "ampaudit/docs_gen.py" in wheel["exclude"] and wheel["force-include"]["rules"] == "ampaudit/_rules"
