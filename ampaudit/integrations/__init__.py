"""Thin wiring of ampaudit into the tools people already use. The work happens in the core; each module here
only connects it, and imports its third-party package lazily (an optional extra):

    ampaudit.integrations.lightning.AmpAuditCallback       pip install 'ampaudit[lightning]'
    ampaudit.integrations.transformers.AmpAuditCallback    pip install 'ampaudit[transformers]'
    ampaudit.integrations.tensorboard.write_tensorboard    pip install 'ampaudit[tensorboard]'
    ampaudit.integrations.precommit                        the `ampaudit-check` pre-commit hook
    ampaudit.pytest_plugin / ampaudit.testing              the `amp_audit` fixture, assert_amp_safe
"""
from __future__ import annotations

from typing import Any, Callable

from ampaudit.errors import MissingExtraError
from ampaudit.extras import require

__all__ = ["MissingExtraError", "callback_session", "require", "tensorboard_at_close"]


def tensorboard_at_close(logdir) -> Callable[[list[dict]], int] | None:
    """The callbacks' ``tensorboard=``: None, or the session's ``on_close`` that writes the run's scalars to
    ``logdir`` (a MissingExtraError now, before training, when tensorboard is not installed)."""
    if logdir is None:
        return None
    from ampaudit.report.tensorboard import writer_at_close

    return writer_at_close(logdir)


def callback_session(trace: Any, *, config: Any = None, **options: Any) -> Any:
    """The watch session a callback drives: ``trace`` and ``options`` as the callback's arguments give them, with
    the trace settings (``trace``, ``trace_every``, ``divergence_every``, and ``tensorboard`` when none is given)
    of ``config``, the run's :class:`~ampaudit.train.config.TrainConfig`, when there is one."""
    from ampaudit.runtime.session import WatchSession

    tensorboard = options.pop("tensorboard", None)
    if config is not None:
        options.update(config.watch_options())
        trace = options.pop("trace")
        if tensorboard is None:
            tensorboard = config.tensorboard
    return WatchSession(trace, on_close=tensorboard_at_close(tensorboard), **options)
