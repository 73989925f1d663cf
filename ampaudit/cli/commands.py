"""Imports each command module so its ``@app.command()`` runs. Add new command modules here."""
import importlib

for _name in ("check", "rules", "train", "report", "fix"):
    try:
        importlib.import_module(f"ampaudit.cli.{_name}")
    except ModuleNotFoundError as exc:  # a command still being built is simply absent
        if exc.name != f"ampaudit.cli.{_name}":
            raise
