"""The `budgetgate` command line: one group, each sub-group in its own module, imported only
when it is run (`LazyGroup`)."""

from __future__ import annotations

import click

from budgetgate.cli.lazy import LazyGroup

# Each command's name and where it is defined; a module is imported when its command runs (or
# when --help lists them all).
COMMANDS = {
    "dev": "budgetgate.cli.dev:dev",
    "db": "budgetgate.cli.db:db",
    "policy": "budgetgate.cli.policy:policy",
    "demo": "budgetgate.cli.demo:demo",
    "bench": "budgetgate.cli.bench:bench",
    "chaos": "budgetgate.cli.chaos:chaos",
    "publish": "budgetgate.cli.publish:publish",
    "usage": "budgetgate.cli.usage:usage",
    "report": "budgetgate.cli.report:report",
    "audit": "budgetgate.cli.audit:audit",
    "evidence": "budgetgate.cli.evidence:evidence",
    "ledger": "budgetgate.cli.ledger:ledger",
    "settlements": "budgetgate.cli.settlements:settlements",
    "budgets": "budgetgate.cli.budgets:budgets",
    "actions": "budgetgate.cli.actions:actions",
    "dlq": "budgetgate.cli.actions:dlq",
    "asyncapi": "budgetgate.cli.asyncapi:asyncapi",
    "quote": "budgetgate.cli.quote:quote",
    "submit": "budgetgate.cli.submit:submit",
    "explain": "budgetgate.cli.explain:explain",
    "status": "budgetgate.cli.status:status",
    "replay": "budgetgate.cli.explain:replay",
    "meter": "budgetgate.cli.meter:meter",
    "kueue": "budgetgate.cli.kueue:kueue",
    "kubernetes": "budgetgate.cli.kubernetes:kubernetes",
    "token": "budgetgate.cli.token:token",
    "admin-log": "budgetgate.cli.token:admin_log",
    "admin": "budgetgate.cli.admin:admin",
    "grant": "budgetgate.cli.grant:grant",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Admission-time GPU budget enforcement, budgets as code."""


if __name__ == "__main__":
    cli()
