"""Fix texts that repeat across the rows of the terminal table, said once: a long parenthesised clause or a
trailing ", or ..." alternative that two or more rows share becomes a reference ``[1]`` in each row and one
footnote under the table (ruff and clippy print a shared help once, not once per hit).

    notes = FixNotes.of(["keep rpn in fp32 (ampaudit.keep_fp32 or ampaudit fix --calibrate -o DIR)",
                         "keep roi_heads in fp32 (ampaudit.keep_fp32 or ampaudit fix --calibrate -o DIR)"])
    notes.shorten(fixes[0])     # "keep rpn in fp32 [1]"
    notes.footnotes             # ["ampaudit.keep_fp32 or ampaudit fix --calibrate -o DIR"]

Only the console shortens: JSON, SARIF and GitHub annotations keep every finding's whole fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# A clause shorter than this stays in the row: its reference would save no line.
MIN_CLAUSE = 24
_ALTERNATIVE = ", or "


@dataclass
class FixNotes:
    clauses: list[str] = field(default_factory=list)     # in the rows' text, as found ("(...)" or ", or ...")

    @classmethod
    def of(cls, fixes: list[str]) -> "FixNotes":
        """The clauses that two or more of ``fixes`` (one per row) share, in order of their first row."""
        seen: dict[str, int] = {}
        for fix in fixes:
            for clause in dict.fromkeys(clauses(fix)):
                seen[clause] = seen.get(clause, 0) + 1
        return cls([c for c, n in seen.items() if n > 1])

    @property
    def footnotes(self) -> list[str]:
        """Each shared clause as its footnote reads: without its parentheses or leading ", or "."""
        return [_bare(c) for c in self.clauses]

    def shorten(self, fix: str) -> str:
        """``fix`` with each shared clause replaced by its reference."""
        # Longest first: a clause of one row can hold another row's ("(a (b))" and "(b)").
        for n, clause in sorted(enumerate(self.clauses, 1), key=lambda nc: -len(nc[1])):
            ref = f", or [{n}]" if clause.startswith(_ALTERNATIVE) else f"[{n}]"
            fix = fix.replace(clause, ref)
        return fix


def clauses(fix: str) -> list[str]:
    """The long top-level parenthesised clauses of ``fix`` ("(...)", nested parentheses kept inside) and its
    trailing alternative (", or ..." after the last top-level parenthesis)."""
    found, depth, start, tail_from = [], 0, 0, 0
    for i, ch in enumerate(fix):
        if ch == "(":
            if depth == 0:
                start = i
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
            if depth == 0:
                found.append(fix[start:i + 1])
                tail_from = i + 1
    if depth:          # unbalanced: leave the text as it is
        return []
    alt = fix.find(_ALTERNATIVE, tail_from)
    if alt >= 0:
        found.append(fix[alt:])
    return [c for c in found if len(_bare(c)) >= MIN_CLAUSE]


def _bare(clause: str) -> str:
    if clause.startswith(_ALTERNATIVE):
        return clause[len(_ALTERNATIVE):]
    return clause[1:-1] if clause.startswith("(") else clause
