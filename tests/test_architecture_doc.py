"""ARCHITECTURE.md cannot drift from the code: every path and dotted name it gives in backticks (or links to)
exists, and every package of ampaudit/ and every table of rules/policy/ has its place in it."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"

_SPAN = re.compile(r"`([^`]+)`")      # a span may wrap onto the next line
_LINK = re.compile(r"\]\(([^)#\s]+)")
_PATH = re.compile(r"(?<![\w./])((?:ampaudit|rules|docs|tests)/[\w./*<>-]*)")
_NAME = re.compile(r"(?<![\w./])(ampaudit(?:\.\w+)+)")


def spans(text: str) -> list[str]:
    """What the document says in backticks, and the targets of its relative links."""
    found = [" ".join(span.split()) for span in _SPAN.findall(text)]
    return found + [t for t in _LINK.findall(text) if "://" not in t]


def paths(text: str) -> set[str]:
    return {m.rstrip(".") for s in spans(text) for m in _PATH.findall(s)}


def names(text: str) -> set[str]:
    return {m for s in spans(text) for m in _NAME.findall(s)}


def path_exists(path: str) -> bool:
    """A file or folder of the repository; a glob (``rules/*.toml``) must match one."""
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def resolve(name: str) -> object:
    """The object ``ampaudit.a.b.C.d`` names: the longest importable module prefix, then attributes.
    Raises ImportError or AttributeError when there is none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise                      # a module exists but needs something missing: say so
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def missing_names(found: set[str]) -> list[str]:
    bad = []
    for name in sorted(found):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{name} ({type(exc).__name__}: {exc})")
    return bad


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_path_exists(text):
    found = paths(text)
    assert len(found) > 40, "the extraction found too few paths: has the document's form changed?"
    assert sorted(p for p in found if not path_exists(p)) == []


def test_every_dotted_name_imports(text):
    found = names(text)
    assert len(found) > 40, "the extraction found too few names: has the document's form changed?"
    assert missing_names(found) == []


def test_every_package_and_policy_table_is_named(text):
    said = paths(text)
    packages = sorted(f"ampaudit/{p.parent.name}/" for p in (ROOT / "ampaudit").glob("*/__init__.py"))
    tables = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "rules" / "policy").glob("*.toml"))
    assert [p for p in packages + tables if p not in said] == []


def test_the_extraction_sees_what_it_must_and_the_check_fails_on_a_moved_name(tmp_path):
    sample = ("See `ampaudit/dtypes.py`, `ampaudit.dtypes.is_low` and `@ampaudit.cli.app.cli_errors`; "
              "[trace](docs/trace.md); `rules/*.toml`; `python -m ampaudit.docs_gen`; `node.meta[\"amp\"]`.\n"
              "`ampaudit/nowhere.py` and `ampaudit.dtypes.no_such_name`, `python -m\nampaudit.no_such_module.x`.")
    assert paths(sample) == {"ampaudit/dtypes.py", "docs/trace.md", "rules/*.toml", "ampaudit/nowhere.py"}
    assert names(sample) == {"ampaudit.dtypes.is_low", "ampaudit.cli.app.cli_errors", "ampaudit.docs_gen",
                             "ampaudit.dtypes.no_such_name", "ampaudit.no_such_module.x"}
    assert [p for p in sorted(paths(sample)) if not path_exists(p)] == ["ampaudit/nowhere.py"]
    assert [b.split()[0] for b in missing_names(names(sample))] == ["ampaudit.dtypes.no_such_name",
                                                                     "ampaudit.no_such_module.x"]


def test_readme_links_the_document():
    assert "(ARCHITECTURE.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
