"""A submission's pool token stays held while its run shows it is alive (a start, usage
records): the reconciler renews its lease from the run's latest sign of life, in Postgres and in
Redis alike. A run that falls silent loses it a lease later, and an ended run gives it back.

Leases here are a few seconds long, so the tests wait for real time to pass: admission judges
leases on its own clock. Each runs on a ledger of one shard and of three, where the token is
taken apart from its decision on the pools' shard, for a tenant on another shard (vision), whose
settlements then lock and change two shards; the last also for a tenant on the pools' shard
(physics), whose holds and token are two units on one shard."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta

import pytest

from budgetgate.core.reconciliation import Rules
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.reconciler.settler import Settler
from tests.support.quotas import BIG_BUDGET, physics, started
from tests.support.waiting import wait_for

POOL = "snowflake:wh-1"
POOLS = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: warehouse}}
spec: {{namespace: "snowflake:wh-1", quota: {quota}, lease_seconds: {lease}}}
---
apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: snowflake}}
spec: {{namespace: snowflake, quota: 5}}
"""
LEASE = 3  # seconds: what the submissions below ask for
_samples = itertools.count()


@pytest.fixture(params=[(1, "physics"), (3, "vision")], ids=["one-shard", "three-shards-apart"])
def ledger_shards(request: pytest.FixtureRequest) -> int:
    """The ledger's shards, the tenant submitting (TEAM) set for the test."""
    shards, team = request.param
    TEAM[0] = team
    return shards


TEAM = ["physics"]  # the tenant of the runs submitted (physics' budget covers it alone: another's runs are unmatched, allowed)


class Run:
    """A run's facts written where the reconciler's consumers record them, and settled."""

    def __init__(self, server, settler: Settler, run_id: str) -> None:  # type: ignore[no-untyped-def]
        self.server, self.settler, self.run_id = server, settler, run_id

    async def fact(self, kind: str, at: datetime | None = None) -> datetime:
        """Record a lifecycle event (or, for "usage", a usage record) dated `at` (now), and settle."""
        at = at or datetime.now(UTC)
        if kind == "usage":
            await self.server.rt.pool.execute(
                "INSERT INTO run_samples (run_id, sample_id, observed_at, gpu, node) VALUES ($1, $2, $3, $4, 0)", self.run_id, f"s{next(_samples)}", at, 1000
            )
        else:
            await self.server.rt.pool.execute(
                "INSERT INTO lifecycle_events (event_id, run_id, kind, event_time) VALUES ($1, $2, $3, $4)", f"e{next(_samples)}", self.run_id, kind, at
            )
        await self.settler.settle(self.run_id)
        return at

    async def lease(self) -> tuple[str, datetime]:
        """The state and lease expiry of the run's token in Postgres."""
        row = await self.server.rt.pool.fetchrow("SELECT state, lease_expires_at FROM pool_allocations WHERE token = $1", f"run:{self.run_id}")
        return row["state"], row["lease_expires_at"]


async def _setup(admission_factory, pg_dsn, shards: int, *, quota: int = 1, lease: int = 3600):  # type: ignore[no-untyped-def]
    files = {"b.yaml": BIG_BUDGET, "p.yaml": POOLS.format(quota=quota, lease=lease)}
    server = await started(admission_factory, pg_dsn, files, ledger_shards=shards)
    bundles = PolicyStore()
    async with server.rt.pool.acquire() as conn:
        await bundles.refresh(conn)
    settler = Settler(pool=server.rt.pool, ledgers=server.rt.ledgers, bundles=bundles, rules=Rules())
    return server, settler


async def _submit(server, run_id: str, **ask: object) -> dict:  # type: ignore[no-untyped-def]
    body = physics(run_id, labels={"team": TEAM[0]}, pool_token={"namespace": POOL, "project": "physics", **ask})
    return (await server.client.post("/v1/admissions", json=body)).json()


async def _holders(server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Live holders of the pool in Redis (as admission counts them): token → lease expiry."""
    return {h["token"]: h["lease_expires_at"] for h in (await server.client.get(f"/v1/pools/{POOL}")).json()["holders"]}


async def _no_holders(server) -> bool:  # type: ignore[no-untyped-def]
    return await _holders(server) == {}


async def _assert_no_drift(server) -> None:  # type: ignore[no-untyped-def]
    for sync in server.rt.ledgers.syncs:
        drift = await sync.check_drift(repair=False)
        assert drift is not None and drift.clean, drift


async def _report_past_the_lease(run: Run, admitted_at: datetime) -> None:
    """Usage every second until twice the lease has passed since admission."""
    while datetime.now(UTC) < admitted_at + timedelta(seconds=2 * LEASE):
        await asyncio.sleep(1)  # the scenario: a live run's meter reports once a second, wall-clock time passing
        await run.fact("usage")


async def _alive_past_the_lease(admission_factory, pg_dsn, shards: int, run_id: str):  # type: ignore[no-untyped-def]
    """A run admitted with a LEASE-second token that started and reported usage every second
    until twice its lease had passed: (server, settler, run, when it was admitted)."""
    server, settler = await _setup(admission_factory, pg_dsn, shards)
    admitted_at = datetime.now(UTC)
    assert (await _submit(server, run_id, lease_seconds=LEASE))["decision"] == "ALLOW"
    run = Run(server, settler, run_id)
    await run.fact("STARTED", admitted_at)
    await _report_past_the_lease(run, admitted_at)
    return server, settler, run, admitted_at


async def test_a_run_reporting_usage_keeps_its_token_past_its_lease(admission_factory, pg_dsn, ledger_shards) -> None:
    server, settler, run, admitted_at = await _alive_past_the_lease(admission_factory, pg_dsn, ledger_shards, "long")

    assert list(await _holders(server)) == ["run:long"]
    state, expires = await run.lease()
    assert state == "held" and expires > datetime.now(UTC) > admitted_at + timedelta(seconds=LEASE)
    refused = await _submit(server, "over-the-cap")
    assert refused["decision"] == "DENY" and f'token pool "{POOL}" is exhausted (used: 1, quota: 1)' in refused["reason"]
    await _assert_no_drift(server)
    # Every renewal and settlement increase took a ledger sequence number and Postgres recorded
    # it (migration 0025): a Redis restored from before the latest is behind, and rebuilt.
    ledger = server.rt.ledgers.of_root("")  # the pools' shard
    committed = await server.rt.pool.fetchval("SELECT budgetgate_committed_ledger_seq($1, $2)", ledger.shard, ledger_shards)
    assert committed == int(await ledger.client.get(ledger.sequence)) > 1


async def test_the_lease_runs_from_the_latest_sign_of_life_for_the_length_asked_else_the_pools(admission_factory, pg_dsn, ledger_shards) -> None:
    server, settler = await _setup(admission_factory, pg_dsn, ledger_shards, quota=3, lease=LEASE + 2)
    assert (await _submit(server, "asked", lease_seconds=LEASE))["decision"] == "ALLOW"
    assert (await _submit(server, "default"))["decision"] == "ALLOW"
    assert (await _submit(server, "granted-before-0024", lease_seconds=LEASE))["decision"] == "ALLOW"
    kept = dict(await server.rt.pool.fetch("SELECT token, lease_seconds FROM pool_allocations"))
    assert kept == {"run:asked": LEASE, "run:default": LEASE + 2, "run:granted-before-0024": LEASE}  # the length granted, kept with the token
    # A token granted before the length was kept (migration 0024) is renewed by its pool's default.
    await server.rt.pool.execute("UPDATE pool_allocations SET lease_seconds = NULL WHERE token = 'run:granted-before-0024'")
    # Wall-clock time is the input: the facts below are dated now, and must come after the grants.
    await asyncio.sleep(0.5)
    for run_id, lease in (("asked", LEASE), ("default", LEASE + 2), ("granted-before-0024", LEASE + 2)):
        run = Run(server, settler, run_id)
        started_at = await run.fact("STARTED")
        assert (await run.lease())[1] == _ms(started_at + timedelta(seconds=lease))
        sampled_at = await run.fact("usage")
        await run.fact("usage", sampled_at - timedelta(milliseconds=300))  # a late sample moves nothing
        assert (await run.lease())[1] == _ms(sampled_at + timedelta(seconds=lease))
    holders = await _holders(server)
    for run_id in ("asked", "default", "granted-before-0024"):
        assert datetime.fromisoformat(holders[f"run:{run_id}"].replace("Z", "+00:00")) == (await Run(server, settler, run_id).lease())[1]
    await _assert_no_drift(server)


async def test_a_run_that_falls_silent_loses_its_token_a_lease_later_and_never_takes_it_back(admission_factory, pg_dsn, ledger_shards) -> None:
    server, settler, run, admitted_at = await _alive_past_the_lease(admission_factory, pg_dsn, ledger_shards, "quiet")
    state, expires = await run.lease()
    assert state == "held" and expires > admitted_at + timedelta(seconds=2 * LEASE)

    # Settling again with no new fact (as the reconciler's upkeep does) renews nothing.
    await settler.settle("quiet")
    assert (await run.lease())[1] == expires
    await wait_for(lambda: _no_holders(server), timeout=(expires - datetime.now(UTC)).total_seconds() + 30, what="the silent run's token run out")
    assert datetime.now(UTC) >= expires, "the token ran out before its lease"
    assert (await _submit(server, "next", lease_seconds=3600))["decision"] == "ALLOW"

    # The silent run speaks again: its place is another holder's, so its token stays run out,
    # also for a settlement whose clock still read a time before the lease ran out.
    await run.fact("usage")
    await settler.settle("quiet", now=expires - timedelta(milliseconds=100))
    assert await run.lease() == ("held", expires)
    assert list(await _holders(server)) == ["run:next"]
    await _assert_no_drift(server)


@pytest.mark.parametrize(
    "ledger_shards", [(1, "physics"), (3, "vision"), (3, "physics")], ids=["one-shard", "three-shards-apart", "three-shards-on-the-pools-shard"], indirect=True
)
async def test_a_renewed_token_goes_back_when_its_run_ends(admission_factory, pg_dsn, ledger_shards) -> None:
    server, settler, run, admitted_at = await _alive_past_the_lease(admission_factory, pg_dsn, ledger_shards, "ends")
    # Alive right before it ends: renewed a LEASE ahead (a CI machine that stalled for the rest of
    # the last second's lease let the token run out before this was read).
    await run.fact("usage")
    assert list(await _holders(server)) == ["run:ends"]
    _, expires = await run.lease()

    await run.fact("COMPLETED")
    assert await _holders(server) == {} and datetime.now(UTC) < expires  # given back before its lease ran out
    await run.fact("usage")  # late metering renews nothing
    assert await run.lease() == ("released", expires)
    assert (await _submit(server, "after"))["decision"] == "ALLOW"
    await _assert_no_drift(server)


def _ms(at: datetime) -> datetime:
    return at.replace(microsecond=at.microsecond // 1000 * 1000)
