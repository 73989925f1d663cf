"""``ampaudit rules``: list the rules, or explain one."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ampaudit.cli.app import app, cli_errors, stdout_console

rules_app = typer.Typer(help="List the rules, or explain one (ampaudit rules explain AMP201).",
                        invoke_without_command=True, no_args_is_help=False)
app.add_typer(rules_app, name="rules")

RulesOpt = Annotated[Optional[list[Path]], typer.Option("--rules", help="Folder of extra rule files (*.toml).")]


@rules_app.callback()
@cli_errors
def rules_main(ctx: typer.Context, rules: RulesOpt = None) -> None:
    """List every rule: id, name, family, default severity."""
    if ctx.invoked_subcommand is not None:
        return
    list_rules(rules)


@rules_app.command("list")
@cli_errors
def list_rules(rules: RulesOpt = None) -> None:
    """List every rule: id, name, family, default severity."""
    from rich.table import Table

    from ampaudit.rules.loader import load_rules

    table = Table("id", "name", "family", "severity", box=None)
    for r in sorted(load_rules([str(p) for p in rules or []]), key=lambda r: r.id.upper()):
        table.add_row(r.id, r.name, r.family, r.severity)
    stdout_console().print(table)


@rules_app.command("explain")
@cli_errors
def explain(rule_id: Annotated[str, typer.Argument(help="Rule id or name, e.g. AMP201.")], rules: RulesOpt = None) -> None:
    """What a rule checks, why it matters, and how to fix it."""
    from ampaudit.rule_index import find_rule, rule_keys

    folders = [str(p) for p in rules or []]
    find_rule(rule_keys(folders), rule_id)      # an unknown id is refused before the matchers (and torch) load
    from ampaudit.rules.loader import load_rules

    r = find_rule(load_rules(folders), rule_id)
    typer.echo(f"{r.id} {r.name} ({r.family}, {r.severity})\n")
    if r.param("docs"):
        typer.echo("Checks: " + " ".join(r.params["docs"]["what"].split()))
    typer.echo("Why: " + " ".join(r.why.split()))
    if r.fix:
        typer.echo("Fix: " + r.fix)
    if r.params.get("ops"):
        typer.echo("Ops: " + ", ".join(r.params["ops"]))
    for ref in r.references:
        typer.echo("See: " + ref)
