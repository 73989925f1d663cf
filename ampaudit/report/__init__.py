"""Renderers: check findings (console, JSON, SARIF) and training traces (summary, HTML)."""
