"""Fix the user's own source files (``ampaudit fix --diff`` / ``--write``), ruff-style, with libcst.

    from ampaudit.sourcefix import fix_source
    result = fix_source("model.py", device="cuda", dtype="float16", calibrate=True)
    print(result.diff()); result.write()

Modules: ``registry`` (fixers by the ``source_fix`` kind rules name), ``cst_tools`` and ``locate`` (finding the
expression a finding is about), ``fixers_expr`` and ``fixers_block`` (the fixers), ``driver`` (planning the edits),
``verify`` (loading and checking the edited copy), ``api`` (the whole run).
"""
from ampaudit.sourcefix.api import SourceFixResult, fix_source

__all__ = ["SourceFixResult", "fix_source"]
