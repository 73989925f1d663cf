"""Command-line interface: ``ampaudit check|rules|fix|train|report``. See :mod:`ampaudit.cli.app`."""
from ampaudit.cli.app import app, main

__all__ = ["app", "main"]
