"""TensorBoard for a trace, where the integrations list it (needs the ``tensorboard`` extra). The writer is
:mod:`ampaudit.report.tensorboard`, a report format like HTML or SARIF; this path stays for existing imports.

    from ampaudit.integrations.tensorboard import write_tensorboard
    n = write_tensorboard(read_trace("run.jsonl")[0], "runs/amp")      # number of scalar points written
"""
from __future__ import annotations

from ampaudit.report.tensorboard import TOP, write_tensorboard, writer_at_close

__all__ = ["TOP", "write_tensorboard", "writer_at_close"]
