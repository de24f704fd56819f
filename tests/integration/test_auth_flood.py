"""A flood of made-up API tokens: it cannot push valid tokens out of the cache, a token of the
wrong shape costs no lookup, and past the failure limit an address's unknown tokens are refused
before Postgres is asked, while its valid token and every other address still get through.
Lookups are counted on the real pool of the test's own database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from budgetgate.core.principals import Role
from budgetgate.access.tokens import PREFIX, TokenStore, new_secret
from tests.support.admission import admission_factory, apply_policies, example_policies, submission  # noqa: F401 - pytest fixtures
from tests.support.principals import bearer, issue

MALFORMED = (
    "bg_not-a-token",
    PREFIX + "!" * 43,  # the right length, not URL-safe base64
    PREFIX + "A" * 42,  # one character short
    new_secret() + "A",  # one too many
    PREFIX + "A" * 21 + "." + "A" * 21,  # a JWT's separator inside
)


class CountedPool:
    """The real pool, counting the token lookups made through it."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.lookups = 0

    async def fetchrow(self, query: str, *args: Any) -> Any:
        self.lookups += 1
        return await self.pool.fetchrow(query, *args)


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[CountedPool]:
    real = await asyncpg.create_pool(pg_dsn, min_size=0, max_size=4)
    try:
        yield CountedPool(real)
    finally:
        await real.close()


async def test_a_flood_of_unknown_tokens_larger_than_the_cache_leaves_valid_tokens_cached(pool: CountedPool, pg_dsn: str) -> None:
    store = TokenStore(pool, cache_seconds=60, max_entries=100)
    valid = await issue(pg_dsn, Role.READER, name="valid")
    assert (await store.principal(valid)).name == "token:valid"  # type: ignore[union-attr]
    assert pool.lookups == 1
    flood = [new_secret() for _ in range(1_200)]  # past both caches: 100 found, 1,000 unknown
    for start in range(0, len(flood), 100):
        assert await asyncio.gather(*(store.principal(s) for s in flood[start : start + 100])) == [None] * 100
    assert pool.lookups == 1 + len(flood)
    assert (await store.principal(valid)).name == "token:valid"  # type: ignore[union-attr]
    assert pool.lookups == 1 + len(flood), "the valid token was looked up again: the flood evicted it"
    # The unknown ones evict each other, oldest first: the latest are still answered from the cache.
    assert await store.principal(flood[-1]) is None and pool.lookups == 1 + len(flood)
    assert await store.principal(flood[0]) is None and pool.lookups == 2 + len(flood)
    assert len(store.unknown) <= 1_000 and len(store.found) == 1


async def test_concurrent_lookups_of_one_unknown_token_ask_postgres_once(pool: CountedPool) -> None:
    store = TokenStore(pool, cache_seconds=60)
    made_up = new_secret()
    assert await asyncio.gather(*(store.principal(made_up) for _ in range(50))) == [None] * 50
    assert pool.lookups == 1
    # A caller that goes away does not cancel the lookup the others share.
    other = new_secret()
    waiting = [asyncio.ensure_future(store.principal(other)) for _ in range(5)]
    await asyncio.sleep(0)  # one turn of the event loop, no time: the five callers start and share one lookup
    waiting[0].cancel()
    done = await asyncio.gather(*waiting, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and done[1:] == [None] * 4 and pool.lookups == 2


async def test_a_malformed_token_is_refused_without_a_lookup(pool: CountedPool, admission_factory) -> None:  # type: ignore[no-untyped-def]
    store = TokenStore(pool, cache_seconds=60)
    for secret in MALFORMED:
        assert await store.principal(secret) is None, secret
    assert pool.lookups == 0
    server = await admission_factory(auth_failure_limit=None)
    counted = _count_lookups(server)
    unknown = await server.client.get("/v1/budgets", headers=bearer(new_secret()))
    assert unknown.status_code == 401 and counted.lookups == 1
    for secret in MALFORMED:
        refused = await server.client.get("/v1/budgets", headers=bearer(secret))
        assert refused.status_code == 401 and refused.json()["detail"] == unknown.json()["detail"], refused.text
        assert refused.headers["www-authenticate"] == unknown.headers["www-authenticate"]
    assert counted.lookups == 1


async def test_an_address_over_the_failure_limit_gets_429_without_lookups_but_its_valid_token_works(admission_factory, pg_dsn: str) -> None:  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory(auth_failure_limit="5/minute", token_cache_seconds=60)
    await server.wait_ready()
    valid = await issue(pg_dsn, Role.READER, Role.SUBMITTER, name="busy-address")
    assert (await server.client.get("/v1/budgets", headers=bearer(valid))).status_code == 200  # cached as valid
    counted = _count_lookups(server)
    answers = [(await server.client.get("/v1/budgets", headers=bearer(new_secret()))).status_code for _ in range(5)]
    assert answers == [401] * 5 and counted.lookups == 5
    for secret in (new_secret(), new_secret(), MALFORMED[0]):
        limited = await server.client.get("/v1/budgets", headers=bearer(secret))
        assert limited.status_code == 429 and 1 <= int(limited.headers["retry-after"]) <= 60, limited.text
        assert limited.headers["content-type"] == "application/problem+json" and "127.0.0.1" in limited.json()["detail"]
    # The plain ASGI fast path of submissions limits the address too.
    fast = await server.client.post("/v1/admissions", json=submission(run_id="flood"), headers=bearer(new_secret()))
    assert fast.status_code == 429 and fast.headers["retry-after"]
    assert counted.lookups == 5, "a limited address's token was looked up"
    assert (await server.client.get("/v1/budgets", headers=bearer(valid))).status_code == 200
    admitted = await server.client.post("/v1/admissions", json=submission(run_id="still-in"), headers=bearer(valid))
    assert admitted.status_code == 200 and admitted.json()["decision"] == "ALLOW", admitted.text
    assert counted.lookups == 5
    # Once its cached answer runs out, a token found valid before is looked up again (a
    # revocation still counts) rather than refused with the flood: callers behind one proxy
    # share its address.
    server.app.state.gate.tokens.found.clear()
    assert (await server.client.get("/v1/budgets", headers=bearer(valid))).status_code == 200 and counted.lookups == 6
    assert (await server.client.get("/v1/budgets", headers=bearer(new_secret()))).status_code == 429 and counted.lookups == 6
    # Another address is counted apart (the whole of 127.0.0.0/8 is this machine's loopback).
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with httpx.AsyncClient(base_url=server.url, transport=transport, timeout=30) as other:
        refused = await other.get("/v1/budgets", headers=bearer(new_secret()))
        assert refused.status_code == 401 and counted.lookups == 7, refused.text
        fresh = await issue(pg_dsn, Role.READER, name="other-address")
        assert (await other.get("/v1/budgets", headers=bearer(fresh))).status_code == 200 and counted.lookups == 8


def _count_lookups(server: Any) -> CountedPool:
    """Count the token lookups of a running service (its Gate's own pool, wrapped)."""
    tokens = server.app.state.gate.tokens
    tokens.pool = CountedPool(tokens.pool)
    return tokens.pool


async def test_a_forwarded_header_does_not_dodge_the_limit_unless_its_proxy_is_trusted(admission_factory, pg_dsn: str) -> None:  # type: ignore[no-untyped-def]
    # From loopback, a different X-Forwarded-For on each request once made every one a new address.
    server = await admission_factory(auth_failure_limit="5/minute")
    spoofed = [(await server.client.get("/v1/budgets", headers={**bearer(new_secret()), "X-Forwarded-For": f"198.51.100.{i}"})).status_code for i in range(8)]
    assert spoofed == [401] * 5 + [429] * 3
    # A trusted proxy's header is believed: the right-most hop it did not add itself is the address.
    behind = await admission_factory(auth_failure_limit="5/minute", trusted_proxies=["127.0.0.0/8"])
    first = [(await behind.client.get("/v1/budgets", headers={**bearer(new_secret()), "X-Forwarded-For": f"198.51.100.{i}"})).status_code for i in range(8)]
    assert first == [401] * 8
    # What the client wrote on the left is not believed: one real client, however it spoofs.
    forged = [
        (await behind.client.get("/v1/budgets", headers={**bearer(new_secret()), "X-Forwarded-For": f"10.9.9.{i}, 203.0.113.7"})).status_code
        for i in range(7)
    ]  # fmt: skip
    assert forged == [401] * 5 + [429] * 2
    limited = await behind.client.get("/v1/budgets", headers={**bearer(new_secret()), "X-Forwarded-For": "203.0.113.7"})
    assert limited.status_code == 429 and "203.0.113.7" in limited.json()["detail"]
