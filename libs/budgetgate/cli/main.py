"""The `budgetgate` command line: one group, each sub-group in its own module."""

from __future__ import annotations

import click

from budgetgate.cli import bench, chaos, db, demo, dev, policy, publish
from budgetgate.cli.usage import usage
from budgetgate.cli.report import report
from budgetgate.cli.actions import actions, dlq
from budgetgate.cli.audit import audit
from budgetgate.cli.evidence import evidence
from budgetgate.cli.ledger import ledger
from budgetgate.cli.settlements import settlements
from budgetgate.cli.budgets import budgets
from budgetgate.cli.asyncapi import asyncapi
from budgetgate.cli.explain import explain, replay
from budgetgate.cli.status import status
from budgetgate.cli.quote import quote
from budgetgate.cli.submit import submit
from budgetgate.cli.whatif import what_if
from budgetgate.cli.meter import meter
from budgetgate.cli.kueue import kueue
from budgetgate.cli.kubernetes import kubernetes
from budgetgate.cli.token import admin_log, token
from budgetgate.cli.admin import admin
from budgetgate.cli.grant import grant


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Admission-time GPU budget enforcement, budgets as code."""


cli.add_command(dev.dev)
cli.add_command(db.db)
cli.add_command(policy.policy)
policy.policy.add_command(what_if)
cli.add_command(demo.demo)
cli.add_command(bench.bench)
cli.add_command(chaos.chaos)
cli.add_command(publish.publish)
cli.add_command(usage)
cli.add_command(report)
cli.add_command(audit)
cli.add_command(evidence)
cli.add_command(ledger)
cli.add_command(settlements)
cli.add_command(budgets)
cli.add_command(actions)
cli.add_command(dlq)
cli.add_command(asyncapi)
cli.add_command(quote)
cli.add_command(submit)
cli.add_command(explain)
cli.add_command(status)
cli.add_command(replay)
cli.add_command(meter)
cli.add_command(kueue)
cli.add_command(kubernetes)
cli.add_command(token)
cli.add_command(admin_log)
cli.add_command(admin)
cli.add_command(grant)


if __name__ == "__main__":
    cli()
