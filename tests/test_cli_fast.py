"""Usage errors, --help and --version answer before torch loads (torch alone takes seconds to import)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SAMPLES

MLP = str(SAMPLES / "clean_mlp.py")
# argv -> (exit code, a piece of its one stderr line, or of stdout for the zero exits)
CASES = {
    ("--version",): (0, "ampaudit"),
    ("--help",): (0, "Usage"),
    ("train", MLP, "--dtype", "float7", "--steps", "1"): (2, "unsupported training dtype 'float7'"),
    ("train", MLP, "--bogus"): (2, "No such option"),
    ("train", "missing_model.py", "--steps", "1"): (2, "model file not found"),
    ("check", "missing_model.py"): (2, "model file not found"),
    ("check", "missing_model.py", "--dtype", "float16"): (2, "model file not found"),
    ("plan", "missing_model.py"): (2, "model file not found"),
    ("fix", "missing_model.py"): (2, "model file not found"),
    ("fix", "missing_model.py", "-o", "out"): (2, "model file not found"),
    ("fix", "missing_model.py", "--diff"): (2, "model file not found"),
    ("check", MLP, "--format", "xml"): (2, "unknown --format 'xml'"),
    ("check", MLP, "-o", "."): (2, "--output . is a folder, not a file"),
    ("plan", MLP, "-o", MLP + "/plan.json"): (2, "clean_mlp.py is a file, not a folder"),
    ("report", "missing.jsonl"): (2, "missing.jsonl"),
    ("doctor", "--format", "xml"): (2, "unknown --format 'xml'"),
    ("check", MLP, "--select", "AMP999"): (2, "--select 'AMP999' matches no rule"),
    ("check", MLP, "--ignore", "AMP2,nonesuch"): (2, "--ignore 'nonesuch' matches no rule"),
    ("rules", "explain", "AMP999"): (2, "unknown rule 'AMP999'"),
}

# Runs each argv through main() in one process and says, for each, its exit code, its output and whether torch
# had been imported by then.
_SCRIPT = """
import contextlib, io, json, sys
from ampaudit.cli.app import main
out = []
for argv in json.loads(sys.argv[1]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    out.append([code, o.getvalue(), e.getvalue(), "torch" in sys.modules])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_usage_errors_help_and_version_do_not_import_torch(tmp_path):
    argvs = [list(a) for a in CASES]
    r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for argv, (code, out, err, torch_loaded) in zip(argvs, json.loads(r.stdout)):
        want_code, piece = CASES[tuple(argv)]
        assert code == want_code, (argv, out, err)
        assert piece in (out if code == 0 else err), (argv, out, err)
        if code:
            assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), (argv, err)
        assert not torch_loaded, f"{argv} imported torch"


def test_train_dtype_words_are_the_training_dtypes_names():
    import torch

    from ampaudit.cli.train import DTYPE_WORDS
    from ampaudit.dtypes import NAMES, TRAIN_DTYPES, parse_train_dtype

    assert {w for w in DTYPE_WORDS if w != "float8"} == {n for n, d in NAMES.items() if d in TRAIN_DTYPES}
    assert all(parse_train_dtype(w) in TRAIN_DTYPES for w in DTYPE_WORDS if w != "float8")
    assert parse_train_dtype("bf16") is torch.bfloat16


def test_the_rule_index_agrees_with_the_loaded_rules():
    from ampaudit.rule_index import rule_keys
    from ampaudit.rules.loader import load_rules

    assert sorted(rule_keys()) == sorted((r.id, r.name, r.family) for r in load_rules())
