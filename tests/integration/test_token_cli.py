"""`budgetgate token create|list|revoke` and `budgetgate admin-log` against a real ledger:
the secret is printed once and only its hash is stored."""

from __future__ import annotations

import asyncio
import hashlib
import json

import asyncpg
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli


def run(dsn: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"BUDGETGATE_POSTGRES_DSN": dsn, "BUDGETGATE_HOME": "/nonexistent"})


async def stored(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [str(dict(r)) for r in await conn.fetch("SELECT * FROM api_tokens")] + [str(dict(r)) for r in await conn.fetch("SELECT * FROM admin_log")]
    finally:
        await conn.close()


def test_create_list_revoke_and_the_admin_log(pg_dsn: str) -> None:
    created = run(pg_dsn, "token", "create", "--name", "flyte-prod", "--role", "submitter", "--namespace", "vision-*", "--tenant", "vision", "--expires", "90d")
    assert created.exit_code == 0, created.output
    secret = created.stdout.splitlines()[0]
    assert secret.startswith("bg_") and len(secret) > 40
    rows = asyncio.run(stored(pg_dsn))
    assert not any(secret in row for row in rows)  # only a hash is kept
    assert any(repr(hashlib.sha256(secret.encode()).digest()) in row for row in rows)

    listed = json.loads(run(pg_dsn, "token", "list", "--json").stdout)
    assert [(t["name"], t["roles"], t["namespaces"], t["tenants"], t["revoked_at"]) for t in listed] == [
        ("flyte-prod", ["submitter"], ["vision-*"], ["vision"], None)
    ]
    assert listed[0]["expires_at"] and secret not in json.dumps(listed)

    assert run(pg_dsn, "token", "create", "--name", "flyte-prod", "--role", "reader").exit_code != 0  # names are unique
    assert run(pg_dsn, "token", "create", "--name", "bad name!", "--role", "reader").exit_code != 0
    assert run(pg_dsn, "token", "create", "--name", "x", "--role", "root").exit_code != 0
    assert run(pg_dsn, "token", "revoke", "flyte-prod").exit_code == 0
    assert run(pg_dsn, "token", "revoke", "flyte-prod").exit_code != 0  # already revoked
    assert json.loads(run(pg_dsn, "token", "list", "--json").stdout)[0]["revoked_at"] is not None

    log = json.loads(run(pg_dsn, "admin-log", "--json").stdout)
    assert [(e["action"], e["subject"]) for e in log] == [("token.revoke", "flyte-prod"), ("token.create", "flyte-prod")]
    assert all(e["actor"].startswith("cli:") for e in log) and log[1]["details"]["roles"] == ["submitter"]


def test_list_has_a_header_row(pg_dsn: str) -> None:
    assert run(pg_dsn, "token", "list").stdout == "no API tokens; `budgetgate token create` makes one\n"
    assert run(pg_dsn, "token", "create", "--name", "ci", "--role", "submitter", "--role", "reader", "--namespace", "vision-*").exit_code == 0
    assert run(pg_dsn, "token", "create", "--name", "operator-on-call", "--role", "operator").exit_code == 0
    assert run(pg_dsn, "token", "revoke", "ci").exit_code == 0
    header, rule, *rows = run(pg_dsn, "token", "list").stdout.splitlines()
    assert header.split() == ["name", "roles", "limited", "to", "created", "by", "state"]
    assert set(rule) == {"-", " "} and len(rows) == 2
    columns = [header.index(name) for name in ("name", "roles", "limited to", "created by", "state")]
    cells = {row.split()[0]: [row[a:b].strip() for a, b in zip(columns, [*columns[1:], None], strict=True)] for row in rows}
    assert cells["ci"][:3] == ["ci", "submitter,reader", "ns=vision-*"] and cells["ci"][4].startswith("revoked ")
    assert cells["operator-on-call"][1:3] == ["operator", "-"] and cells["operator-on-call"][4] == "live"
    assert all(c[3].startswith("cli:") for c in cells.values())
