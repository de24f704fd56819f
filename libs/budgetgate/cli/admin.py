"""`budgetgate admin tenant show|update`: a tenant's quotas and budgets in force, and overrides of
them, through admission's API (`GET`/`PUT /v1/tenants/{tenant}`) with the project's client."""

from __future__ import annotations

import json
from typing import Any

import click

from budgetgate.cli.calling import call
from budgetgate.core.overrides import FIELDS


@click.group()
def admin() -> None:
    """Administration through admission's API."""


@admin.group()
def tenant() -> None:
    """A tenant's quotas and budgets: show them, override them."""


def _call(work: Any) -> Any:
    return call(work, service="admission", url=lambda client: client.url)


@tenant.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(name: str, as_json: bool) -> None:
    """Each setting of tenant NAME in force, and whether it comes from Git or an override."""
    answer = _call(lambda client: client.tenant(name))
    _print(answer.model_dump(mode="json"), as_json)


_HOURS = click.FloatRange(min=0, min_open=True)


@tenant.command()
@click.argument("name")
@click.option("--max-nodes", type=click.IntRange(min=0), help="hard quota: nodes held at once")
@click.option("--max-gpus", type=click.IntRange(min=0), help="hard quota: GPUs held at once")
@click.option("--max-concurrent-allocations", type=click.IntRange(min=0), help="hard quota: runs admitted at once")
@click.option("--gpu-hours-budget", type=_HOURS, help="the limit of the tenant's soft GPU-hour budget")
@click.option("--node-hours-budget", type=_HOURS, help="the limit of the tenant's soft node-hour budget")
@click.option("--fair-share-target", type=click.FloatRange(min=0, max=1, min_open=True), help="share of the cluster's GPUs")
@click.option("--burst-allowance", type=click.FloatRange(min=1, max=100), help="burst limit = target × this")
@click.option("--clear", "cleared", multiple=True, type=click.Choice(FIELDS), help="put a setting back to the Git bundle's value (repeatable)")
@click.option("--reason", help="why, for the admin log")
@click.option("--create", is_flag=True, help="NAME is a new tenant: neither the Git bundle nor an override names it yet (else refused, as a typo)")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def update(name: str, cleared: tuple[str, ...], reason: str | None, create: bool, as_json: bool, **values: Any) -> None:
    """Override settings of tenant NAME; hard quotas apply from the next decision on."""
    changes: dict[str, Any] = {field: value for field, value in values.items() if value is not None}
    both = sorted(set(changes) & set(cleared))
    if both:
        raise click.UsageError(f"{', '.join(both)}: set or --clear, not both")
    changes.update(dict.fromkeys(cleared))
    if not changes:
        raise click.UsageError("name a setting to change (e.g. --max-nodes 250) or --clear one")
    body = {**changes, **({"reason": reason} if reason else {})}
    answer = _call(lambda client: client.update_tenant(name, body, create=create))
    _print(answer.model_dump(mode="json"), as_json)


def _print(answer: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    revision = f"override revision {answer['revision']} by {answer['changed_by']} at {answer['changed_at']}" if answer["revision"] else "no overrides"
    click.echo(f"tenant {answer['tenant']} ({answer['label']}={answer['tenant']}) on bundle {answer['policy_bundle_sha']}: {revision}")
    for field in FIELDS:
        setting = answer["settings"][field]
        value = "-" if setting["value"] is None else f"{setting['value']:g}"
        note = f" (Git: {setting['git']:g})" if setting["source"] == "override" and setting["git"] is not None else ""
        budget = f" [{setting['policy_id']}]" if setting.get("policy_id") else ""
        click.echo(f"  {field:<28} {value:>12}  {setting['source']}{note}{budget}")
