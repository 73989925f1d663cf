"""Imports each command module so its ``@app.command()`` runs. Add new command modules here."""
import importlib

for _name in ("check", "rules", "train", "report", "fix", "plan", "doctor"):
    importlib.import_module(f"ampaudit.cli.{_name}")
