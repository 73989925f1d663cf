"""Every bench/ script still starts: its imports resolve and ``--help`` exits 0 (one process for all of them)."""
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = """
import runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        failed.append(f"{path}: --help did not exit")
    except SystemExit as exc:
        if exc.code not in (0, None):
            failed.append(f"{path}: exit {exc.code}")
    except Exception as exc:  # an import that no longer resolves, a renamed function
        failed.append(f"{path}: {type(exc).__name__}: {exc}")
sys.stderr.write("".join(f"BENCH-FAIL {line}\\n" for line in failed))   # stdout holds their --help
"""


@pytest.mark.slow
def test_every_bench_script_starts():
    scripts = sorted(str(p) for p in (ROOT / "bench").glob("*.py")
                     if "__main__" in p.read_text(encoding="utf-8"))
    assert len(scripts) >= 10
    done = subprocess.run([sys.executable, "-c", PROBE, *scripts], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BENCH-FAIL" not in done.stderr, done.stderr[-3000:]
