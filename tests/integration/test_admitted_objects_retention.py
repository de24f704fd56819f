"""The retention of admitted_objects on real Postgres: the Kubernetes objects the webhook admitted
are forgotten once their run ended longer ago than the retention, in bounded passes that walk the
table by index; the objects of a run with no end yet stay, however old."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from budgetgate.ledger.queries import owned_by
from tests.support.reconciler import reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

sql = owned_by("budgetgate.services.reconciler")  # its own queries, then the shared ledger's

NOW = datetime.now(UTC)
RETENTION = timedelta(days=7)
LONG_AGO = NOW - timedelta(days=30)


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(pg_dsn)
    yield connection
    await connection.close()


async def decide(conn: asyncpg.Connection, run_id: str, *, attempt: int = 1, outcome: str = "ALLOW", at: datetime = LONG_AGO) -> uuid.UUID:
    decision_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at) "
        "VALUES ($1, $2, $3, $4, 'test', 'vision', '{}', 8, '{}', '{}', $5)",
        decision_id, run_id, attempt, outcome, at,
    )  # fmt: skip
    return decision_id


async def settle(
    conn: asyncpg.Connection, run_id: str, decision_id: uuid.UUID, *, phase: str, at: datetime, final: bool = False, released: bool = False
) -> None:
    await conn.execute(
        "INSERT INTO run_settlements (run_id, decision_id, phase, final, released, ended_at, projected_gpu, settled_at) VALUES ($1, $2, $3, $4, $5, $6, 8, $7)",
        run_id, decision_id, phase, final, released, at if phase == "ended" else None, at,
    )  # fmt: skip


async def admit(conn: asyncpg.Connection, uid: str, run_id: str, *, at: datetime = LONG_AGO, kind: str = "Job") -> None:
    await conn.execute(
        "INSERT INTO admitted_objects (uid, namespace, kind, name, run_id, admitted_at) VALUES ($1, 'vision', $2, $1, $3, $4)", uid, kind, run_id, at
    )


async def prune(conn: asyncpg.Connection, *, after: tuple[datetime, str] | None = None, limit: int = 1000) -> asyncpg.Record:
    return await conn.fetchrow(sql("prune_admitted_objects"), NOW - RETENTION, *(after or (None, None)), limit)


async def left(conn: asyncpg.Connection) -> set[str]:
    return {r["uid"] for r in await conn.fetch("SELECT uid FROM admitted_objects")}


async def ended_run(conn: asyncpg.Connection, run_id: str, *, at: datetime = NOW - timedelta(days=8)) -> None:
    await settle(conn, run_id, await decide(conn, run_id), phase="ended", final=True, at=at)


async def test_objects_of_runs_that_ended_before_the_retention_go_and_every_other_stays(conn: asyncpg.Connection) -> None:
    eight_days_ago, two_days_ago = NOW - timedelta(days=8), NOW - timedelta(days=2)
    await ended_run(conn, "completed")  # reconciled with actuals eight days ago
    await admit(conn, "job-completed", "completed")
    await admit(conn, "pod-completed", "completed", kind="Pod")
    await settle(conn, "never-started", await decide(conn, "never-started"), phase="admitted", released=True, at=eight_days_ago)
    await admit(conn, "job-never-started", "never-started")
    await settle(conn, "evicted", await decide(conn, "evicted"), phase="evicted", released=True, at=eight_days_ago)
    await admit(conn, "job-evicted", "evicted")
    # Stay: ended within the retention; admitted within it (a child recorded after its owner's
    # run ended); still running a month on; started after its reservation was given back; ended
    # but not yet reconciled; never settled; denied; an unknown run id; admitted again after the
    # admission its settlement is of.
    await ended_run(conn, "recent", at=two_days_ago)
    await admit(conn, "job-recent", "recent")
    await admit(conn, "pod-completed-late", "completed", at=two_days_ago, kind="Pod")
    await settle(conn, "long-training", await decide(conn, "long-training"), phase="running", at=LONG_AGO)
    await admit(conn, "job-long-training", "long-training")
    await settle(conn, "late-start", await decide(conn, "late-start"), phase="running", released=True, at=eight_days_ago)
    await admit(conn, "job-late-start", "late-start")
    await settle(conn, "metering", await decide(conn, "metering"), phase="ended", at=eight_days_ago)
    await admit(conn, "job-metering", "metering")
    await decide(conn, "unsettled")
    await admit(conn, "job-unsettled", "unsettled")
    await decide(conn, "denied", outcome="DENY")
    await admit(conn, "job-denied", "denied")
    await admit(conn, "job-undecided", "undecided")
    await ended_run(conn, "again", at=LONG_AGO)
    await decide(conn, "again", attempt=2, at=eight_days_ago)
    await decide(conn, "again", attempt=3, outcome="DENY", at=eight_days_ago)
    await admit(conn, "job-again", "again")
    before = await left(conn)

    page = await prune(conn)

    gone = {"job-completed", "pod-completed", "job-never-started", "job-evicted"}
    assert (page["looked"], page["pruned"]) == (len(before) - 1, len(gone))  # all but the one admitted within the retention
    assert await left(conn) == before - gone
    assert (await prune(conn))["pruned"] == 0


async def test_a_pass_looks_at_a_bounded_batch_and_the_walk_goes_on_past_objects_that_stay(conn: asyncpg.Connection) -> None:
    # The oldest objects are of a run still going: a pass that only ever looked at the oldest
    # would look at them for ever and prune nothing behind them.
    await settle(conn, "going", await decide(conn, "going"), phase="running", at=LONG_AGO)
    await ended_run(conn, "done")
    for i in range(3):
        await admit(conn, f"going-{i}", "going", at=LONG_AGO + timedelta(seconds=i))
    for i in range(3):
        await admit(conn, f"done-{i}", "done", at=LONG_AGO + timedelta(seconds=10 + i))
    await admit(conn, "done-3", "done", at=LONG_AGO + timedelta(seconds=12))  # the same instant as done-2

    pages, after = [], None
    while True:
        page = await prune(conn, after=after, limit=2)
        pages.append((page["looked"], page["pruned"]))
        if page["looked"] < 2:
            break
        after = (page["last_at"], page["last_uid"])
        assert len(pages) < 10, "the walk does not end"

    assert pages == [(2, 0), (2, 1), (2, 2), (1, 1)]
    assert await left(conn) == {"going-0", "going-1", "going-2"}


async def test_a_pass_reads_only_by_index(conn: asyncpg.Connection) -> None:
    # A table grown large (nothing pruned it before): the pass walks the admission-order index
    # and reads the settlements and decisions of the objects it looks at by their keys.
    await conn.execute(
        "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at) "
        "SELECT gen_random_uuid(), 'run-' || g, 1, 'ALLOW', 'test', 'vision', '{}', 8, '{}', '{}', $1 FROM generate_series(1, 20000) g",
        LONG_AGO,
    )
    await conn.execute(
        "INSERT INTO run_settlements (run_id, decision_id, phase, final, projected_gpu, settled_at) "
        "SELECT run_id, decision_id, 'ended', run_id LIKE '%0', 8, $1 FROM decisions",
        NOW - timedelta(days=8),
    )
    await conn.execute(
        "INSERT INTO admitted_objects (uid, namespace, kind, name, run_id, admitted_at) "
        "SELECT 'uid-' || g, 'vision', 'Pod', 'p', 'run-' || (g % 20000 + 1), $1::timestamptz + g * interval '1 second' FROM generate_series(1, 50000) g",
        LONG_AGO,
    )
    await conn.execute("ANALYZE admitted_objects, run_settlements, decisions, decision_keys")

    [plan] = json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql("prune_admitted_objects"), NOW - RETENTION, None, None, 1000))
    scans = list(_scans(plan["Plan"]))

    assert ("Index Scan", "admitted_objects", "admitted_objects_admitted_at_uid") in scans, scans
    assert not [s for s in scans if s[0] in ("Seq Scan", "Bitmap Heap Scan")], scans
    assert (await prune(conn))["looked"] == 1000


def _scans(node: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    if "Relation Name" in node:
        yield node["Node Type"], node["Relation Name"], node.get("Index Name", "")
    for child in node.get("Plans", ()):
        yield from _scans(child)


async def test_the_reconciler_prunes_in_its_upkeep_and_logs_how_many(reconciler_factory, conn: asyncpg.Connection, caplog) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="budgetgate.services.reconciler.service")
    await ended_run(conn, "completed")
    await admit(conn, "job-completed", "completed")
    await ended_run(conn, "recent", at=NOW - timedelta(days=1))
    await admit(conn, "job-recent", "recent")
    await settle(conn, "long-training", await decide(conn, "long-training"), phase="running", at=LONG_AGO)
    await admit(conn, "job-long-training", "long-training")

    reconciler = await reconciler_factory(admitted_objects_retention_seconds=RETENTION.total_seconds())

    async def pruned() -> bool:
        return "job-completed" not in await left(conn)

    await wait_for(pruned, what="the objects of a run that ended eight days ago forgotten")
    assert await left(conn) == {"job-recent", "job-long-training"}
    await wait_for(
        lambda: _logged(caplog, "forgot 1 admitted Kubernetes objects of runs that ended more than 7 days, 0:00:00 ago"), what="the log line of the walk"
    )
    # The upkeep is done before the consumer has connected; stopped mid-connect, aiokafka leaves
    # a socket for a later test to collect and fail on (CI saw it), so the test ends once it has.
    await wait_for(lambda: _running(reconciler), what="the reconciler's consumer started")


async def _running(reconciler) -> bool:  # type: ignore[no-untyped-def]
    return bool(reconciler.broker.running)


async def _logged(caplog, text: str) -> bool:  # type: ignore[no-untyped-def]
    return any(text in r.getMessage() for r in caplog.records)
