"""The one exception hierarchy of ampaudit.

Every error a user can cause derives from :class:`AmpAuditError`. Library code raises these; only the CLI turns
them into a one-line message and exit code 2 (``AMPAUDIT_DEBUG=1`` shows the traceback). Each error carries a
``hint``: the next step for the user.

    raise ModelLoadError("no model found in net.py (tried build_model, model)", hint="name it with --entry NAME")
"""
from __future__ import annotations


class AmpAuditError(Exception):
    """Base of every error ampaudit raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        """The message and the hint on one line, as the CLI prints it."""
        text = " ".join(self.message.split())
        return f"{text}; {self.hint}" if self.hint else text


class UsageError(AmpAuditError):
    """Bad flags or option values."""


class ModelLoadError(AmpAuditError):
    """The model file or factory could not be loaded, or built no model."""


class InputError(AmpAuditError):
    """Example inputs are missing, malformed, or do not fit ``forward``."""


class CaptureError(AmpAuditError):
    """The model could not be captured as a graph."""


class RuleError(AmpAuditError):
    """A rule file is malformed, or a rule id is unknown."""


class ConfigError(AmpAuditError):
    """``[tool.ampaudit]`` in pyproject.toml is malformed."""


class TraceError(AmpAuditError):
    """A trace file is missing or unreadable."""


class TrainError(AmpAuditError):
    """Training cannot start or continue (missing train_data/loss_fn, fp16 weights without masters, ...)."""


class MissingExtraError(AmpAuditError, ImportError):
    """An optional package is not installed; the message names the extra that installs it
    (:func:`ampaudit.extras.require`)."""


class TrainingHalted(AmpAuditError):
    """The trainer stopped on purpose (too many skipped steps); exit code 3, distinct from errors."""

    exit_code = 3
