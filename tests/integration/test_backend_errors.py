"""Every service classifies backend failures with one tuple, and it covers what a real Postgres
says when an administrator ends a session (57P01), which must mean 503 and never 500."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from budgetgate.runtime import backends
from budgetgate.ledger import rewrite
from budgetgate.ledger.redis_ledger import RedisLedger, RefusingWrites
from budgetgate.services.admission import admitter
from budgetgate.services.metering_ingest.routes import samples as metering_api
from tests.support.pg_sessions import in_pg_sleep
from tests.support.waiting import wait_for


async def test_admin_shutdown_of_a_session_is_a_backend_error(pg_dsn) -> None:
    victim = await asyncpg.connect(pg_dsn)
    admin = await asyncpg.connect(pg_dsn)
    try:
        pid = victim.get_server_pid()
        query = asyncio.create_task(victim.fetchval("SELECT pg_sleep(30)"))
        # Wait until the query really runs in the victim's backend, then end the session.
        await wait_for(lambda: in_pg_sleep(admin, pid), timeout=30, what="the victim's query running")
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(BaseException) as raised:
            await query
    finally:
        await admin.close()
        victim.terminate()
    # asyncpg reports a session ended mid-query as the connection lost, naming the reason.
    assert "administrator command" in str(raised.value)
    assert isinstance(raised.value, backends.BACKEND_ERRORS)


@pytest.mark.parametrize("sqlstate", ["57P01", "57P02", "57P03"])
def test_operator_intervention_is_a_backend_error_in_every_service(sqlstate: str) -> None:
    # What asyncpg raises when the server answers with these SQLSTATEs (e.g. 57P01 to a query
    # that reaches a backend being shut down by an administrator).
    error = asyncpg.PostgresError.new({"C": sqlstate, "M": "terminating connection due to administrator command", "S": "FATAL"})
    assert error.sqlstate == sqlstate
    for tuple_ in (backends.BACKEND_ERRORS, admitter.BACKEND_ERRORS, metering_api.BACKEND_ERRORS):
        assert isinstance(error, tuple_)


def test_every_service_uses_the_one_tuple() -> None:
    assert admitter.BACKEND_ERRORS is backends.BACKEND_ERRORS
    assert metering_api.BACKEND_ERRORS is backends.BACKEND_ERRORS


@pytest.mark.parametrize(
    "sqlstate",
    [
        "40001",  # serialization failure
        "40P01",  # deadlock detected
        "53100",  # disk full
        "53200",  # out of memory
        "53300",  # too many connections
        "25006",  # read-only transaction: a write reached a standby
    ],
)
def test_transient_server_states_are_backend_errors(sqlstate: str) -> None:
    error = asyncpg.PostgresError.new({"C": sqlstate, "M": "transient", "S": "ERROR"})
    assert isinstance(error, backends.BACKEND_ERRORS)


def test_a_request_fault_is_not_a_backend_error() -> None:
    for sqlstate in ("22003", "23505", "42601"):  # out of range, unique violation, syntax error
        assert not isinstance(asyncpg.PostgresError.new({"C": sqlstate, "M": "no", "S": "ERROR"}), backends.BACKEND_ERRORS)
    assert not isinstance(redis.exceptions.ResponseError("ERR wrong number of arguments"), backends.BACKEND_ERRORS)


async def test_a_script_refused_by_a_read_only_redis_is_an_outage(killable_redis) -> None:
    # Inside a script the refusal is a plain ResponseError naming it in its text; the ledger
    # raises it as redis-py's ReadOnlyError, which every service takes for an outage.
    client = aioredis.from_url(killable_redis.url)
    ledger = RedisLedger(client, prefix="ro-test")
    try:
        await client.set(ledger.marker, "1")
        await client.execute_command("REPLICAOF", "127.0.0.1", "1")
        with pytest.raises(redis.exceptions.ReadOnlyError) as raised:
            await ledger.load_key("k", reserved=1, consumed=0)
        assert isinstance(raised.value, backends.BACKEND_ERRORS)
        assert isinstance(raised.value.__cause__, redis.exceptions.ResponseError) and "READONLY" in str(raised.value.__cause__)
        await client.execute_command("REPLICAOF", "NO", "ONE")
        await ledger.load_key("k", reserved=1, consumed=0)  # taken again once it is a primary
        assert await ledger.readings(["k"]) == {"k": (1, 0)}
    finally:
        await client.aclose()


async def test_a_redis_refusing_writes_for_too_few_replicas_is_an_outage(killable_redis) -> None:
    # NOREPLICAS (like MISCONF and BUSY) has no error class in redis-py: the ledger raises it
    # as RefusingWrites, a ConnectionError, where it was a ResponseError the reconciler counted
    # against the run it settled.
    client = aioredis.from_url(killable_redis.url)
    ledger = RedisLedger(client, prefix="norep-test")
    try:
        await client.set(ledger.marker, "1")
        await client.config_set("min-replicas-to-write", 1)  # and there are none
        with pytest.raises(RefusingWrites) as raised:
            await ledger.load_key("k", reserved=1, consumed=0)
        assert isinstance(raised.value, backends.BACKEND_ERRORS) and "NOREPLICAS" in str(raised.value)
        # A plain command too: a rebuild meeting it is an outage (503, retried), not a fault.
        with pytest.raises(RefusingWrites):
            # `holding` proves the rewrite still holds the ledger lock: here there is none to prove.
            await rewrite.replace_all(ledger, ledgers={"k": (1, 0)}, runs={}, generation="g", holding=lambda: asyncio.sleep(0))
        await client.config_set("min-replicas-to-write", 0)
        await ledger.load_key("k", reserved=1, consumed=0)
        assert await ledger.readings(["k"]) == {"k": (1, 0)}
    finally:
        await client.aclose()
