"""The `budgetgate` command line: one group, each sub-group in its own module."""

from __future__ import annotations

import click

from budgetgate.cli import bench, db, demo, dev, policy, publish
from budgetgate.cli.usage import usage
from budgetgate.cli.audit import audit


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Admission-time GPU budget enforcement, budgets as code."""


cli.add_command(dev.dev)
cli.add_command(db.db)
cli.add_command(policy.policy)
cli.add_command(demo.demo)
cli.add_command(bench.bench)
cli.add_command(publish.publish)
cli.add_command(usage)
cli.add_command(audit)


if __name__ == "__main__":
    cli()
