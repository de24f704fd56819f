"""`budgetgate token create|list|revoke` and `budgetgate admin-log`: API tokens and the log of
administrative actions, in the ledger database."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta
from typing import Any

import click

from budgetgate.cli import backend
from budgetgate.cli.tables import table
from budgetgate.core.principals import Role

_DURATION = re.compile(r"^(\d+)([mhdw])$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _valid_name(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise click.BadParameter("1 to 100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return value


_MINUTES = {"m": 1, "h": 60, "d": 24 * 60, "w": 7 * 24 * 60}
# A token that should outlive this is one without --expires (it lives until revoked).
LONGEST = timedelta(days=100 * 366)


def parse_duration(text: str) -> timedelta:
    """`90d`, `12h`, `30m`, `2w`; at most a hundred years."""
    found = _DURATION.match(text.strip())
    if found is None or int(found.group(1)) == 0:
        raise click.BadParameter(f"{text!r} is not a duration like 90d, 12h, 30m or 2w")
    minutes = int(found.group(1)) * _MINUTES[found.group(2)]
    if minutes > LONGEST / timedelta(minutes=1):
        raise click.BadParameter(f"{text!r} is longer than 100 years; leave --expires out for a token that lives until revoked")
    return timedelta(minutes=minutes)


@click.group()
def token() -> None:
    """API tokens: create (the secret is printed once), list, revoke."""


@token.command()
@click.option("--name", required=True, callback=_valid_name, help="a unique name, e.g. flyte-prod")
@click.option("--role", "roles", required=True, multiple=True, type=click.Choice([str(r) for r in Role]), help="repeat for several roles")
@click.option("--namespace", "namespaces", multiple=True, help="limit to namespaces matching this glob, e.g. 'vision-*' (repeatable; per role, see above)")
@click.option("--tenant", "tenants", multiple=True, help="limit to this tenant, a value of BUDGETGATE_TENANT_LABEL (repeatable; per role, see above)")
@click.option("--expires", help="lifetime, e.g. 90d; none = until revoked")
def create(name: str, roles: tuple[str, ...], namespaces: tuple[str, ...], tenants: tuple[str, ...], expires: str | None) -> None:
    """Create a token and print its secret (shown only this once; Postgres keeps a hash).

    Without --namespace and --tenant a token is not limited. With them, a run, decision or budget
    is within the limits when its namespace matches a --namespace glob (if any is given) and its
    tenant (the value of its BUDGETGATE_TENANT_LABEL label, `team` by default) is a --tenant (if
    any is given). What the limits hold back, per role (docs/authentication.md):

    \b
    submitter   submits (admissions, quotes, the Kubernetes webhook) and looks up
                decisions only within the limits; a pool shows it only the holders
                within them. Pool tokens it allocates are not limited (only their
                holder renews or releases one).
    exporter    posts samples and lifecycle events only of runs whose decision is
                within the limits (else 403, nothing recorded). A sample of a run
                not decided yet is kept, and counts only if the run turns out to be
                within them; a lifecycle event of such a run is refused.
    reader,     reads budgets, scope usage, decisions and pool holders only within
    auditor     the limits (a budget over every namespace: only without --namespace);
                a tenant's usage only without --namespace, its settings not with
                --namespace alone; user usage and a protected /metrics only
                without any limit.
    operator    reads as a reader; overrides a tenant's quotas and budgets only for
                a --tenant (not at all with --namespace alone); applies no policy
                bundle with any limit. Pool token releases are NOT limited.
    accounting  reads budgets and usage as a reader (it looks up no decisions or
                pools); overrides as an operator.
    """
    from budgetgate.access.tokens import create_token

    lifetime = parse_duration(expires) if expires else None
    settings = backend.stack_settings()

    async def run() -> Any:
        import asyncpg

        async with backend.postgres(settings.postgres_dsn) as conn:
            try:
                return await create_token(
                    conn,
                    name=name,
                    roles=[Role(r) for r in roles],
                    namespaces=list(namespaces),
                    tenants=list(tenants),
                    created_by=backend.actor(),
                    expires_in=lifetime,
                )
            except asyncpg.UniqueViolationError:
                raise click.ClickException(f"a token named {name!r} exists already (names are never reused, even revoked)") from None

    issued = asyncio.run(run())
    click.echo(issued.secret)
    until = f", expires {issued.expires_at.isoformat(timespec='seconds')}" if issued.expires_at else ""
    click.echo(f"token {name!r} created ({', '.join(roles)}{until}); the secret above is not shown again", err=True)


@token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_(as_json: bool) -> None:
    """Every token: name, roles, limits, who created it, expiry and revocation (never secrets)."""
    from budgetgate.access.tokens import list_tokens

    settings = backend.stack_settings()

    async def run() -> list[dict[str, Any]]:
        async with backend.postgres(settings.postgres_dsn) as conn:
            return await list_tokens(conn)

    rows = [
        {k: (v.isoformat(timespec="seconds") if hasattr(v, "isoformat") else str(v) if k == "token_id" else v) for k, v in r.items()}
        for r in asyncio.run(run())
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no API tokens; `budgetgate token create` makes one")
        return
    lines = []
    for r in rows:
        state = f"revoked {r['revoked_at']}" if r["revoked_at"] else (f"expires {r['expires_at']}" if r["expires_at"] else "live")
        limits = " ".join([*(f"ns={n}" for n in r["namespaces"]), *(f"tenant={t}" for t in r["tenants"])]) or "-"
        lines.append([r["name"], ",".join(r["roles"]), limits, r["created_by"], state])
    for line in table(["name", "roles", "limited to", "created by", "state"], lines):
        click.echo(line)


@token.command()
@click.argument("name")
def revoke(name: str) -> None:
    """Revoke a token by name; every instance refuses it within seconds."""
    from budgetgate.access.tokens import revoke_token

    settings = backend.stack_settings()

    async def run() -> bool:
        async with backend.postgres(settings.postgres_dsn) as conn:
            return await revoke_token(conn, name=name, revoked_by=backend.actor())

    if not asyncio.run(run()):
        raise click.ClickException(f"no live token named {name!r}")
    click.echo(f"token {name!r} revoked")


@click.command("admin-log")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000), help="how many entries, newest first")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def admin_log(limit: int, as_json: bool) -> None:
    """Administrative actions, newest first: who did what, when (token changes, policy applies)."""
    from budgetgate.access.tokens import admin_log as read_log

    settings = backend.stack_settings()

    async def run() -> list[dict[str, Any]]:
        async with backend.postgres(settings.postgres_dsn) as conn:
            return await read_log(conn, limit=limit)

    rows = asyncio.run(run())
    if as_json:
        click.echo(json.dumps([{**r, "logged_at": r["logged_at"].isoformat()} for r in rows], indent=2))
        return
    for r in rows:
        click.echo(
            f"{r['logged_at'].isoformat(timespec='seconds')}  {r['actor']:<28} {r['action']:<14} {r['subject']}  {json.dumps(r['details'], sort_keys=True)}"
        )
