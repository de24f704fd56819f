"""`budgetgate ledger …`: Redis's copy of the ledger (Postgres is the truth; Redis is rebuilt from
it: libs/budgetgate/ledger/redis_sync.py does the work, under the exclusive ledger lock), and the
monthly partitions of Postgres's growing tables: created ahead, archived past the retention,
restored (libs/budgetgate/ledger/partitions.py, archive.py)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pathlib import Path
from typing import Any

import click

from budgetgate.cli import backend
from budgetgate.runtime.settings import CommonSettings, RetentionSettings

if TYPE_CHECKING:
    from budgetgate.ledger.redis_sync import Drift, LedgerSync


@click.group()
def ledger() -> None:
    """The ledger: its Redis copy (rebuild it from Postgres, compare the two) and Postgres's monthly
    partitions (create them ahead, archive the months past the retention, restore one)."""


def _settings() -> CommonSettings:
    # Both servers named (by the local stack or by variables): never the defaults' 127.0.0.1,
    # where a rebuild would rewrite whatever Redis happens to run there.
    return backend.stack_settings(needs=("postgres", "redis"))


@ledger.command("rebuild-redis")
def rebuild_redis() -> None:
    """Replace Redis's copy of the ledger with Postgres's.

    After a restore of Postgres, a Redis loss or a drift the reconciler reports. Safe while the
    services run: reservations wait for the rebuild, which takes the ledger lock exclusively.
    Also deletes the keys left under the tags of a former number of shards (after
    BUDGETGATE_LEDGER_SHARDS was changed with every process stopped).
    """
    settings = _settings()
    keys, runs, former = asyncio.run(_rebuild(settings))
    shards = f" ({settings.ledger_shards} shards)" if settings.ledger_shards > 1 else ""
    click.echo(f"rebuilt Redis from Postgres{shards}: {keys} ledger key(s), {runs} run(s) holding reservations")
    if former:
        click.echo(f"deleted {former} key(s) under the tags of a former number of shards (BUDGETGATE_LEDGER_SHARDS was changed)")


@ledger.command("check")
def check() -> None:
    """Compare Redis with Postgres; exit 1 when they differ (nothing is changed)."""
    found, warning = asyncio.run(_drift(_settings()))
    if warning is not None:
        click.echo(f"warning: {warning}")
    if any(drift is None for drift in found.values()):
        unloaded = sorted(shard for shard, drift in found.items() if drift is None)
        where = "" if len(found) == 1 else f" on shard{'s' if len(unloaded) > 1 else ''} {', '.join(map(str, unloaded))}"
        click.echo(f"Redis does not hold the ledger{where} (it is rebuilt before the next decision, or by `budgetgate ledger rebuild-redis`)")
        sys.exit(1)
    if all(drift.clean for drift in found.values() if drift is not None):
        click.echo("Redis matches Postgres")
        return
    for shard, drift in found.items():
        if drift is not None and not drift.clean:
            if len(found) > 1:
                click.echo(f"shard {shard}:")
            _differences(drift)
    sys.exit(1)


def _differences(drift: Drift) -> None:
    for key, (in_redis, in_postgres) in drift.keys.items():
        click.echo(f"ledger key {key}: Redis (reserved, consumed) {in_redis}, Postgres {in_postgres}")
    for run_id, (in_redis, in_postgres) in drift.runs.items():
        click.echo(f"run {run_id}: Redis holds {in_redis}, Postgres {in_postgres}")
    for name, (in_redis, in_postgres) in drift.counters.items():
        click.echo(f"quota counter {name}: Redis (gpus, nodes, allocations, lease size, its unit) {in_redis}, Postgres {in_postgres}")
    for namespace, (in_redis, in_postgres) in drift.pools.items():
        click.echo(f"pool {namespace}: Redis holds tokens {sorted(in_redis)}, Postgres {sorted(in_postgres)}" + _leases(in_redis, in_postgres))
    for lease, (in_redis, in_postgres) in drift.sizes.items():
        click.echo(f"escrow lease {lease}: Redis size {in_redis}, Postgres {in_postgres}")


def _leases(in_redis: dict[str, tuple[int, str]], in_postgres: dict[str, tuple[int, str]]) -> str:
    """Tokens both hold, but for another lease or owner."""
    differing = sorted(t for t in in_redis.keys() & in_postgres.keys() if in_redis[t] != in_postgres[t])
    return f" (lease or project differs for {', '.join(differing)})" if differing else ""


async def _rebuild(settings: CommonSettings) -> tuple[int, int, int]:
    """Every shard rebuilt: the ledger keys and runs it holds now, and how many keys of former
    shards were deleted."""
    from budgetgate.ledger.sharded import forget_former_shards

    keys = runs = 0
    async with _syncs(settings) as syncs:
        for sync in syncs:
            await sync.rebuild(force=True)
            keys, runs = keys + len(await sync.redis.all_readings()), runs + len(await sync.redis.run_holds())
        former = await forget_former_shards(syncs[0].redis.client, syncs[0].redis.shards)
    return keys, runs, former


async def _drift(settings: CommonSettings) -> tuple[dict[int, Drift | None], str | None]:
    """Each shard's differences (None: the shard is not loaded), and a warning about the Redis
    Cluster's settings (budgetgate.ledger.sharded.whole_cluster_stops)."""
    from budgetgate.ledger.sharded import whole_cluster_stops

    async with _syncs(settings) as syncs:
        found = {sync.redis.shard: await sync.check_drift(repair=False) for sync in syncs}
        return found, await whole_cluster_stops(syncs[0].redis.client, settings.ledger_shards)


@contextlib.asynccontextmanager
async def _syncs(settings: CommonSettings) -> AsyncIterator[tuple[LedgerSync, ...]]:
    """The LedgerSync of every shard of the ledger on the stack's Postgres and Redis (both
    checked reachable), closed on exit."""
    from budgetgate.ledger.sharded import ShardedLedger

    async with backend.postgres_pool(settings.postgres_dsn) as pool, backend.redis(settings.redis_url) as client:
        ledgers = await ShardedLedger.open(pool, client, prefix=settings.redis_prefix, count=settings.ledger_shards, tenant_label=settings.tenant_label)  # type: ignore[arg-type]
        yield ledgers.syncs


@ledger.command("roots")
@click.option(
    "--policies", type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Take the account tree of this policy folder's committed revision instead of the active bundle's.",
)  # fmt: skip
@click.option("--apply", "apply_", is_flag=True, help="Pin the tree's organisations as roots and rebuild every shard (every process stopped).")
@click.option("--force", is_flag=True, help="With --apply: go on although other sessions are connected to the database.")
def roots_command(policies: Path | None, apply_: bool, force: bool) -> None:
    """The roots the ledger's shards place tenants by: each tenant the account tree names under an
    organisation keeps its keys on that organisation's shard, any other tenant on its own.

    Without --apply, shows the roots pinned now and what the tree (of the active bundle, or of
    --policies) would change. The roots are read once by every process when it starts, so they
    change only with every process stopped: --apply refuses while other sessions are connected
    to the database, pins the tree's organisations, and rebuilds every shard of the Redis ledger,
    which moves each tenant's keys to its new shard. Start the processes after it.
    """
    from budgetgate.core.shards import RootConflict, Shards, organisations
    from budgetgate.ledger.roots import SessionsConnected, moves, pin
    from budgetgate.ledger.sharded import pinned_roots

    settings = _settings()

    async def run() -> None:
        async with backend.postgres(settings.postgres_dsn) as conn:
            current = await pinned_roots(conn)  # type: ignore[arg-type]
            if policies is not None:
                from budgetgate.cli.policy import load_revision

                bundle = load_revision(policies, allow_dirty=False, committed=True)[1].bundle
            else:
                from budgetgate.policies.override_store import NoActiveBundle, active_bundle

                try:
                    bundle = await active_bundle(conn)
                except NoActiveBundle as exc:
                    raise click.ClickException(str(exc)) from None
            try:
                wanted = organisations(bundle.accounts, settings.tenant_label)
            except RootConflict as exc:
                raise click.ClickException(str(exc)) from None
            shards = Shards(settings.redis_prefix, settings.ledger_shards, current)
            after = Shards(settings.redis_prefix, settings.ledger_shards, wanted)
            pinned = f"{len(current)} tenant(s) under {len(set(current.values()))} organisation(s)" if current else "none (every tenant is its own root)"
            click.echo(f"pinned now: {pinned}")
            for organisation in sorted(set(current.values())):
                click.echo(f"  {organisation}: {', '.join(t for t, r in sorted(current.items()) if r == organisation)}")
            changed = moves(current, wanted)
            click.echo(f"the account tree of bundle {bundle.git_sha} ({settings.tenant_label} label): {len(changed)} tenant(s) move")
            for move in changed:
                click.echo(f"  {move.describe(shards, after)}")
            if not apply_ or not changed:
                return
            try:
                await pin(conn, wanted, bundle_sha=bundle.git_sha, force=force)  # type: ignore[arg-type]
            except SessionsConnected as exc:
                raise click.ClickException(str(exc)) from None
        keys, runs, _ = await _rebuild(settings)
        click.echo(f"pinned; rebuilt Redis from Postgres with them: {keys} ledger key(s), {runs} run(s) holding reservations")

    asyncio.run(run())


@ledger.command("leases")
@click.option("--since-minutes", default=60.0, show_default=True, type=click.FloatRange(0), help="Count the escrow moves made in this many minutes.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (amounts in the ledger's units).")
def leases_command(since_minutes: float, as_json: bool) -> None:
    """The escrow leases of a ledger of several shards: for every budget tenants share, and the
    sensitive-workload pool, the limit, what no lease holds, each tenant's lease (its size, its
    use, its unused room) and the grants, returns and reclaims made lately, as Postgres records
    them (reservations in flight in Redis come on top)."""
    import json

    report = asyncio.run(_leases(_settings(), since_minutes))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    if not report:
        click.echo("no budget or pool is carved into leases (one shard, or nothing shared decided on yet)")
        return
    for carved in report:
        amount = _amounts(carved["unit"])
        click.echo(f"{carved['carved']}: limit {amount(carved['limit'])}, free {amount(carved['free'])}, {len(carved['leases'])} lease(s)")
        for lease in carved["leases"]:
            click.echo(f"  {lease['root'] or '(no tenant)'}: size {amount(lease['size'])}, used {amount(lease['used'])}, unused {amount(lease['unused'])}")
        for move in carved["moves"]:
            click.echo(f"  last {since_minutes:g} min: {move['moves']} {move['kind']}(s) ({move['reason']}), {amount(move['amount'])}")


def _amounts(unit: str):  # type: ignore[no-untyped-def]
    """How the report writes an amount of `unit`: a budget's as a person writes it, a pool's as a count."""
    from budgetgate.core.evaluation import describe
    from budgetgate.core.policy import Unit

    if unit in ("gpus", "nodes"):
        return lambda amount: f"{amount} {unit}"
    return lambda amount: describe(Unit(unit), amount)


async def _leases(settings: CommonSettings, since_minutes: float) -> list[dict[str, Any]]:
    from datetime import UTC, datetime, timedelta

    from budgetgate.ledger.escrow_leases import CounterBook, escrow_report
    from budgetgate.ledger.holds import SENSITIVE
    from budgetgate.policies.override_store import NoActiveBundle, active_bundle

    async with backend.postgres(settings.postgres_dsn) as conn:
        try:
            pool = (await active_bundle(conn)).sensitive
        except NoActiveBundle:
            pool = None
        sensitive = CounterBook(SENSITIVE, pool.unit, pool.size) if pool is not None else None
        return await escrow_report(conn, sensitive=sensitive, since=datetime.now(UTC) - timedelta(minutes=since_minutes))  # type: ignore[arg-type]


@ledger.command("partitions")
@click.option("--ahead", type=click.IntRange(1, 120), default=None, help="Months to create ahead of this one [BUDGETGATE_LEDGER_PARTITIONS_AHEAD_MONTHS, 3].")
def partitions_command(ahead: int | None) -> None:
    """Create the monthly partitions ahead, then list every partition and archived month.

    Rows the default partitions hold (of a month that had no partition yet) are moved into their
    months' partitions. Services do this themselves on start and once an hour."""
    from budgetgate.ledger.partitions import month_label

    settings = backend.stack_settings()
    created, found, archived = asyncio.run(_partitions(settings.postgres_dsn, settings.ledger_partitions_ahead_months if ahead is None else ahead))
    click.echo(f"created {len(created)} partition(s)" + (": " + ", ".join(created) if created else ""))
    for p in found:
        if p.default:
            click.echo(f"  {p.name:<36} {'default: rows of months without a partition':<48} {p.rows} row(s)")
        else:
            click.echo(f"  {p.name:<36} {month_label(p.start):<48} ~{max(p.rows, 0)} row(s)")
    for a in archived:
        click.echo(f"  {a['partition']:<36} archived {a['archived_at']:%Y-%m-%d}: {a['row_count']} row(s) in {a['location']}")


async def _partitions(dsn: str, ahead: int) -> tuple[list[str], list[Any], list[Any]]:
    """The partitions created, every partition (the default ones' rows counted exactly: rows
    there are worth a look) and the archived months."""
    import asyncpg

    from budgetgate.ledger import partitions
    from budgetgate.ledger.queries import sql

    async with backend.postgres(dsn) as conn:
        try:
            created = await partitions.ensure(conn, ahead=ahead)  # type: ignore[arg-type]
        except asyncpg.LockNotAvailableError as exc:
            why = "a table stayed locked, or rows of a month arrived as it was made; try again"
            raise click.ClickException(f"partitions not created, nothing changed: {exc} ({why})") from None
        found = await partitions.partitions(conn, exact_defaults=True)  # type: ignore[arg-type]
        archived = await conn.fetch(sql("ledger_archives"), None)  # type: ignore[attr-defined]
    return created, found, archived


@ledger.command("archive")
@click.option(
    "--to", "directory", type=click.Path(file_okay=False, path_type=Path), default=None, help="Where to write the archives [BUDGETGATE_LEDGER_ARCHIVE_DIR]."
)
@click.option(
    "--retention-months", type=click.IntRange(1), default=None, help="Months kept in Postgres [BUDGETGATE_LEDGER_RETENTION_MONTHS; unset: nothing is archived]."
)
@click.option("--dry-run", is_flag=True, help="Say which months would be archived, and which are kept and why; change nothing.")
def archive_command(directory: Path | None, retention_months: int | None, dry_run: bool) -> None:
    """Archive the months of usage, decisions and the outbox past the retention to files, then drop them from Postgres.

    Each month, oldest first: its partitions copied to compressed CSV files with a manifest,
    read back and counted, then detached and dropped (a crash leaves Postgres as it was, or the
    next run finishes the month). A month holding a run still open, or an outbox row not
    published, is refused, naming them; exit 1 when any month was refused. `budgetgate ledger
    restore MANIFEST` brings one back."""
    settings = backend.stack_settings(RetentionSettings)
    months = retention_months or settings.ledger_retention_months
    if months is None:
        click.echo("no retention set (BUDGETGATE_LEDGER_RETENTION_MONTHS, or --retention-months): nothing is archived")
        return
    where = directory or (Path(settings.ledger_archive_dir) if settings.ledger_archive_dir else None)
    if where is None and not dry_run:
        raise click.ClickException("say where the archives go: --to DIR, or BUDGETGATE_LEDGER_ARCHIVE_DIR")
    from budgetgate.ledger.partitions import month_label

    report = asyncio.run(_archive(settings, months, where or Path("."), dry_run))
    click.echo(f"months ending on or before {report.cutoff:%Y-%m-%d} ({months} month(s) kept):")
    for series, month, named in report.would_archive:
        click.echo(f"  would archive {series} {month_label(month)}: {', '.join(named.values())}")
    for done in report.archived:
        tables = ", ".join(f"{t.partition} ({t.rows} rows)" for t in done.tables)
        click.echo(f"  archived {done.series} {month_label(done.month)}: {tables} -> {done.manifest}")
    for kept in report.kept:
        click.echo(f"  {kept}")
    if not (report.would_archive or report.archived or report.kept):
        click.echo("  nothing to archive")
    if report.refused:
        raise SystemExit(1)


async def _archive(settings: RetentionSettings, months: int, directory: Path, dry_run: bool) -> Any:
    """The archive's report; each month said on stderr as it is done."""
    import asyncpg

    from budgetgate.ledger.archive import ArchiveError, archive

    async with backend.postgres(settings.postgres_dsn) as conn:
        try:
            return await archive(
                conn,  # type: ignore[arg-type]
                retention_months=months,
                directory=directory,
                dry_run=dry_run,
                ahead=settings.ledger_partitions_ahead_months,
                say=lambda line: click.echo(line, err=True),
            )
        except (ArchiveError, OSError, asyncpg.LockNotAvailableError) as exc:
            raise click.ClickException(f"nothing more was archived (the months said above are): {exc}") from None


@ledger.command("restore")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def restore_command(manifest: Path) -> None:
    """Bring an archived month back into Postgres from its MANIFEST (manifest.json).

    Every file is checked against the manifest (digest and rows) before anything is loaded; the
    month is then loaded, attached as its partition again and no longer counted as archived, in
    one transaction. `budgetgate ledger archive` archives it again once it is past the retention."""
    from budgetgate.ledger.archive import ArchiveError, restore

    async def run():  # type: ignore[no-untyped-def]
        async with backend.postgres(backend.stack_settings().postgres_dsn) as conn:
            return await restore(conn, manifest)  # type: ignore[arg-type]

    try:
        done = asyncio.run(run())
    except ArchiveError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"restored {done.series} {done.month}: " + ", ".join(f"{p} ({n} rows)" for p, n in done.tables))
    if done.moved_from_default:
        click.echo(f"  and moved {done.moved_from_default} row(s) of that month from the default partition into it")
