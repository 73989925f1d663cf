"""Output piped into a reader that leaves early (``ampaudit ... | head -1``) ends quietly: exit 141, no stderr."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ampaudit.cli.pipes import PIPE_GONE


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with stdout a pipe whose reader has already gone: its first write breaks."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "ampaudit", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)


def _into_head(*args: str) -> tuple[int, str, str]:
    """``ampaudit ARGS | head -1``: the reader takes one line and leaves."""
    proc = subprocess.Popen([sys.executable, "-m", "ampaudit", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), first, err


@pytest.mark.slow
@pytest.mark.parametrize("args", [("check", "--help"), ("--help",)])
def test_help_into_a_closed_pipe_is_quiet(args):
    # rich meets the broken pipe while typer prints the help
    r = _into_closed_pipe(*args)
    assert (r.returncode, r.stderr) == (PIPE_GONE, "")


@pytest.mark.slow
def test_a_command_body_into_a_closed_pipe_is_quiet():
    # explain writes with typer.echo inside the command: not "unexpected BrokenPipeError"
    r = _into_closed_pipe("rules", "explain", "AMP201")
    assert (r.returncode, r.stderr) == (PIPE_GONE, "")


@pytest.mark.slow
def test_head_takes_a_line_and_the_rest_is_quiet():
    code, first, err = _into_head("rules", "explain", "AMP201")
    assert first.startswith("AMP201 ")
    assert code in (0, PIPE_GONE) and err == ""     # 0 when every line was written before head left


@pytest.mark.slow
def test_a_finished_command_whose_reader_left_keeps_its_exit_code():
    # the output fit in the pipe before the reader closed it: nothing was lost, so the command's own code stands
    code = subprocess.run([sys.executable, "-c", "import os; r, w = os.pipe(); os.dup2(w, 1); os.close(r); "
                           "from ampaudit.cli.pipes import PipeWatch; import sys; "
                           "sys.stderr.write(str(PipeWatch().exit_code(0)))"],
                          capture_output=True, text=True, timeout=60)
    assert code.stderr == "0"
