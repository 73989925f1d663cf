"""pytest plugin (registered by the ``pytest11`` entry point ``ampaudit``): the ``amp_audit`` fixture.

    def test_fp16_safe(amp_audit):
        amp_audit(MyNet(), torch.randn(8, 64))                   # defaults from [tool.ampaudit]
        amp_audit(MyNet(), x, fail_on="error", calibrate=True)   # per-call overrides
        report = amp_audit.check(MyNet(), x)                     # the report, without asserting

Defaults come from ``[tool.ampaudit]`` in the nearest pyproject.toml above the test file (``device``, ``dtype``,
``fail-on``, ``select``, ``ignore``, ``rules``); anything not set there falls back to
:func:`ampaudit.testing.assert_amp_safe`'s own defaults. Disable the plugin with ``-p no:ampaudit``.

This module imports only pytest at start-up: torch and the auditor load the first time a test uses the fixture,
so projects that never use it pay nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# [tool.ampaudit] key (normalised) -> assert_amp_safe keyword
_CONFIG_KEYS = {"device": "device", "dtype": "dtype", "fail_on": "fail_on", "select": "select", "ignore": "ignore",
                "rules": "rules_dirs", "speed": "speed"}


class AmpAudit:
    """What the ``amp_audit`` fixture returns: :func:`~ampaudit.testing.assert_amp_safe` with project defaults."""

    def __init__(self, defaults: dict[str, Any], source: Path | None = None):
        self.defaults = defaults
        self.source = source          # the pyproject.toml the defaults came from, or None

    def __call__(self, model: Any, *example_inputs: Any, **options: Any):
        """Assert ``model`` is safe; keyword options override the project defaults (see assert_amp_safe)."""
        __tracebackhide__ = True
        from ampaudit.testing import assert_amp_safe

        return assert_amp_safe(model, *example_inputs, **{**self.defaults, **options})

    def check(self, model: Any, *example_inputs: Any, **options: Any):
        """The report for ``model`` under the project defaults, without failing the test."""
        from ampaudit.testing import assert_amp_safe

        return assert_amp_safe(model, *example_inputs, **{**self.defaults, **options, "fail_on": "never"})

    def __repr__(self) -> str:
        return f"AmpAudit(defaults={self.defaults!r}, source={str(self.source) if self.source else None!r})"


def project_defaults(start: Path) -> tuple[dict[str, Any], Path | None]:
    """``[tool.ampaudit]`` of the nearest pyproject.toml above ``start``, as assert_amp_safe keywords."""
    from ampaudit.config import find_pyproject, load_config

    path = find_pyproject(start)
    if path is None:
        return {}, None
    cfg = load_config(path=path)
    return {_CONFIG_KEYS[k]: v for k, v in cfg.items() if k in _CONFIG_KEYS}, path


@pytest.fixture
def amp_audit(request: pytest.FixtureRequest) -> AmpAudit:
    """Assert a model is mixed-precision safe, with the defaults of ``[tool.ampaudit]``."""
    start = Path(str(request.path)).parent if getattr(request, "path", None) else Path(str(request.config.rootpath))
    defaults, source = project_defaults(start)
    return AmpAudit(defaults, source)
