"""The sensitive-workload quota on the Redis ledger sharded by tenant (BUDGETGATE_LEDGER_SHARDS=3),
end to end on real Postgres, Redis and Kafka: the pool is carved into tenants' escrow leases, each
a counter on its tenant's shard that the tenant's sensitive runs count on in their decision's one
script; a lease that lacks room is refilled from what no lease holds, then from room other
tenants' leases hold unused, before a run is refused; the leases together never hold more than the
pool. A ledger suite: on a Redis Cluster the shards' tags hash to different slots."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.ledger.escrow_leases import CounterBook
from budgetgate.ledger.holds import SENSITIVE, sensitive_lease
from tests.support.admission import apply_policies, budget_yaml, decision_of, submission, wait_for_bundle
from tests.support.cli import budgetgate_on
from tests.support.reconciler import feed, lifecycle, reconciler_factory, wait_caught_up  # noqa: F401 - pytest fixtures
from tests.support.sharded import GPU_HOUR, SHARDS, TENANTS, policies
from tests.support.waiting import wait_for

POOL = 24  # GPUs sensitive runs may hold at once, every tenant's together; each run asks for 8
SENSITIVE_QUOTA = f"apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {{id: sensitive}}\nspec: {{sensitive_pool_size: {POOL}}}\n"
REFUSED = "allocation rejected: sensitive workloads would exceed sensitive_pool_size"


def sensitive_run(tenant: str, n: int, **labels: str) -> dict[str, object]:
    return submission(
        run_id=f"{tenant}/s-{n}",
        namespace="ml",
        labels={"team": tenant, "sensitive": "true", **labels},
        resources={"gpus": 8, "nodes": 1},
        projected_runtime_hours=1.0,
        job=None,
    )


async def started(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, {**policies(), "sensitive.yaml": SENSITIVE_QUOTA}, sha="8" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    return server


async def figures(pg_dsn: str) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Postgres's leases of the sensitive pool (tenant -> size), what each tenant's sensitive runs
    hold (GPUs), and the reasons of the moves recorded."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        sizes = {r["root"]: r["size"] for r in await conn.fetch("SELECT root, size FROM counter_leases WHERE counter = 'sensitive'")}
        rows = await conn.fetch("SELECT tenant, sum(gpus)::int AS gpus FROM run_holds WHERE state = 'held' AND sensitive GROUP BY tenant")
        held = {r["tenant"]: r["gpus"] for r in rows}
        reasons = [r["reason"] for r in await conn.fetch("SELECT reason FROM escrow_moves WHERE ledger_key = 'counter:sensitive' ORDER BY id")]
        return sizes, held, reasons
    finally:
        await conn.close()


async def in_redis(server, tenant: str) -> dict[int, tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Every shard holding the tenant's lease counter: shard -> (GPUs held, size)."""
    found = {}
    for ledger in server.rt.ledgers:
        gpus, size = await ledger.client.hmget(ledger.keys.counter(sensitive_lease(tenant)), "gpus", "size")
        if gpus is not None or size is not None:
            found[ledger.shard] = (int(gpus or 0), int(size or 0))
    return found


async def assert_leases_agree(server, pg_dsn) -> None:  # type: ignore[no-untyped-def]
    """No lease above the pool together; each on its tenant's shard alone, with the size and the
    GPUs Postgres has; the drift check clean on every shard."""
    sizes, held, _ = await figures(pg_dsn)
    assert sum(sizes.values()) <= POOL and sum(held.values()) <= POOL, (sizes, held)
    for tenant in TENANTS:
        found = await in_redis(server, tenant)
        assert set(found) <= {server.rt.ledgers.of_root(tenant).shard}, found
        assert found.get(server.rt.ledgers.of_root(tenant).shard, (0, 0)) == (held.get(tenant, 0), sizes.get(tenant, 0)), (tenant, found, sizes, held)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_the_sensitive_pool_is_carved_into_tenants_leases_and_admits_exactly_what_it_holds(
    admission_factory,
    reconciler_factory,
    feed,
    pg_dsn,  # noqa: F811
) -> None:
    """Twelve sensitive runs of six tenants on three shards, 8 GPUs each, at once, against a pool
    of 24: exactly three are admitted (never more, and no refusal while the pool had room),
    each counted on its tenant's lease on its tenant's shard; the others are refused with the
    pool's reason; explain reproduces both kinds; a quote answers as admission would. When an
    admitted run ends, its lease's room goes to another tenant's next run by a reclaim. A shard
    that lost its state is rebuilt with its leases' sizes and counts."""
    server = await started(admission_factory, pg_dsn)
    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=sensitive_run(t, n)) for n in range(2) for t in TENANTS))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    bodies = [a.json() for a in answers]
    allowed = [b for b in bodies if b["decision"] == "ALLOW"]
    assert len(allowed) == POOL // 8, [(b["run_id"], b["decision"], b.get("reason")) for b in bodies]
    denied = [b for b in bodies if b["decision"] != "ALLOW"]
    assert all(b["reason"].startswith(REFUSED) for b in denied), denied[0]
    for body in (allowed[0], denied[0]):
        explained = (await server.client.get(f"/v1/admissions/{body['run_id']}/explain")).json()
        assert explained["identical"] is True, explained
    await assert_leases_agree(server, pg_dsn)
    sizes, held, reasons = await figures(pg_dsn)
    assert sum(held.values()) == POOL and "refill" in reasons

    outsider = next(t for t in TENANTS if not held.get(t))
    quoted = (await server.client.post("/v1/quotes", json=sensitive_run(outsider, 9))).json()
    assert quoted["decision"] == "DENY" and quoted["reason"].startswith(REFUSED), quoted  # the pool is full: no refill would help

    # One admitted run ends: its 8 GPUs are its tenant's lease's, unused; another tenant's next run
    # reclaims them (a quote forecasts it).
    ended = allowed[0]["run_id"]
    await feed.send(lifecycle(ended, "STARTED", datetime.now(UTC) - timedelta(minutes=5), gpus=8), lifecycle(ended, "COMPLETED", datetime.now(UTC)))
    await wait_caught_up(reconciler)

    async def released() -> bool:
        return sum((await figures(pg_dsn))[1].values()) == POOL - 8

    await wait_for(released, what="the ended run's sensitive GPUs given back")
    quoted = (await server.client.post("/v1/quotes", json=sensitive_run(outsider, 9))).json()
    assert quoted["decision"] == "ALLOW", quoted
    taken = (await server.client.post("/v1/admissions", json=sensitive_run(outsider, 9))).json()
    assert taken["decision"] == "ALLOW", taken
    sizes, held, reasons = await figures(pg_dsn)
    assert held[outsider] == 8 and f"reclaim:{outsider}" in reasons, (held, reasons)
    await assert_leases_agree(server, pg_dsn)

    # A shard that lost its state is rebuilt with its leases' sizes and counts.
    lost = server.rt.ledgers.of_root(outsider)
    await lost.client.delete(*[k async for k in lost.client.scan_iter(match=f"{lost.tag}:*")])
    refused = (await server.client.post("/v1/admissions", json=sensitive_run(outsider, 10))).json()
    assert refused["decision"] == "DENY" and refused["reason"].startswith(REFUSED), refused  # rebuilt first, then decided on it
    await assert_leases_agree(server, pg_dsn)


async def test_a_smaller_pool_takes_back_what_leases_hold_unused_and_a_sensitive_run_must_name_its_tenant(admission_factory, pg_dsn) -> None:
    """The bundle made the pool smaller than its leases hold together: the reconciler's sweep
    (Escrow.return_idle) has each lease give back what its tenant does not hold until they fit,
    idle or not. A sensitive run naming no tenant cannot count on any lease: 422, naming the label."""
    server = await started(admission_factory, pg_dsn)
    escrow = server.rt.admitter.escrow
    book = CounterBook(SENSITIVE, "gpus", POOL)
    for tenant in TENANTS[:3]:
        assert await escrow.grant(book, tenant, 8, reason="refill") == 8
    assert decision_of(await server.client.post("/v1/admissions", json=sensitive_run(TENANTS[0], 0))) == "ALLOW"

    smaller = CounterBook(SENSITIVE, "gpus", 12)
    moved = await escrow.return_idle(idle=timedelta(hours=1), chunk_share=0.02, now=datetime.now(UTC), counters=[smaller])
    sizes, held, _ = await figures(pg_dsn)
    assert sum(sizes.values()) <= 12 and sizes[TENANTS[0]] == 8 == held[TENANTS[0]], (sizes, moved)  # what a run holds stays
    assert all(key == "counter:sensitive" for key, _ in moved)
    await assert_leases_agree(server, pg_dsn)

    no_tenant = submission(run_id="anon/s-0", namespace="ml", labels={"sensitive": "true"}, resources={"gpus": 1, "nodes": 1}, job=None)
    answer = await server.client.post("/v1/admissions", json=no_tenant)
    assert answer.status_code == 422 and "must name its tenant" in answer.text, answer.text


async def held_nodes_and_gpus(pg_dsn: str) -> tuple[int, int]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        held = "SELECT COALESCE(sum(nodes), 0)::int AS nodes, COALESCE(sum(gpus), 0)::int AS gpus FROM run_holds WHERE state = 'held' AND sensitive"
        row = await conn.fetchrow(held)
        return row["nodes"], row["gpus"]
    finally:
        await conn.close()


async def unit_sizes(pg_dsn: str) -> dict[str, tuple[int, str | None]]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        return {r["root"]: (r["size"], r["unit"]) for r in await conn.fetch("SELECT root, size, unit FROM counter_leases WHERE counter = 'sensitive'")}
    finally:
        await conn.close()


async def test_a_pool_counted_in_another_unit_voids_every_lease_of_the_former_unit(admission_factory, pg_dsn) -> None:
    """The bundle counts the sensitive pool in nodes where it counted GPUs: no lease's size is
    read in the new unit (two leases of 16 and 8 GPUs would admit 24 nodes of a pool of 3). The
    first grant in the new unit voids every lease of the former one, on every shard, so exactly
    what the pool has room for is admitted; and counting GPUs again revives none of them."""
    server = await started(admission_factory, pg_dsn)
    escrow, book = server.rt.admitter.escrow, CounterBook(SENSITIVE, "gpus", POOL)
    first, second = TENANTS[0], next(t for t in TENANTS if server.rt.ledgers.of_root(t).shard != server.rt.ledgers.of_root(TENANTS[0]).shard)
    assert await escrow.grant(book, first, 16, reason="refill") == 16
    assert await escrow.grant(book, second, 8, reason="refill") == 8

    def run(tenant: str, n: int) -> dict[str, object]:
        return {**sensitive_run(tenant, n), "resources": {"gpus": 2, "nodes": 1}}

    assert decision_of(await server.client.post("/v1/admissions", json=run(first, 0))) == "ALLOW"

    def quota(size: int, unit: str) -> dict[str, str]:
        spec = f"{{sensitive_pool_size: {size}, sensitive_unit: {unit}}}"
        return {**policies(), "sensitive.yaml": f"apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {{id: sensitive}}\nspec: {spec}\n"}

    await apply_policies(pg_dsn, quota(3, "nodes"), sha="7" * 40)
    await wait_for_bundle(server, "7" * 40)
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=run(t, n)) for n in range(1, 5) for t in (first, second)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert sum(a.json()["decision"] == "ALLOW" for a in answers) == 2, [a.json().get("reason") for a in answers]  # 3 nodes, 1 held before
    assert await held_nodes_and_gpus(pg_dsn) == (3, 6)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])
    sizes = await unit_sizes(pg_dsn)
    assert sum(size for size, unit in sizes.values() if unit == "nodes") <= 3 and all(unit == "nodes" or size == 0 for size, unit in sizes.values()), sizes
    assert all([await sync.rebuild(force=True) for sync in server.rt.ledgers.syncs])  # each lease's unit rebuilt with its size
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])

    await apply_policies(pg_dsn, quota(6, "gpus"), sha="6" * 40)
    await wait_for_bundle(server, "6" * 40)  # GPUs again: 6, which the three runs hold
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=run(t, n)) for n in range(5, 7) for t in TENANTS))
    assert [a.json()["decision"] for a in answers] == ["DENY"] * len(answers), [a.json().get("reason") for a in answers]
    assert await held_nodes_and_gpus(pg_dsn) == (3, 6)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_a_shard_that_lost_the_emptying_of_a_lease_of_the_former_unit_is_rebuilt_before_it_decides(admission_factory, pg_dsn) -> None:
    """A grant in nodes emptied the GPU leases on every shard; a replica promoted before it had
    that is still holding a tenant's 8-GPU lease, behind the sequence Postgres recorded with the
    emptying. Deciding on it would count that tenant's runs on a lease Postgres no longer has; the
    shard is rebuilt first, and exactly three 8-GPU runs are admitted."""
    server = await started(admission_factory, pg_dsn)
    escrow = server.rt.admitter.escrow
    first, second = TENANTS[0], next(t for t in TENANTS if server.rt.ledgers.of_root(t).shard != server.rt.ledgers.of_root(TENANTS[0]).shard)
    assert await escrow.grant(CounterBook(SENSITIVE, "gpus", POOL), second, 8, reason="refill") == 8
    lost = server.rt.ledgers.of_root(second)
    seq, generation = int(await lost.client.get(lost.sequence)), await lost.generation()
    assert await escrow.grant(CounterBook(SENSITIVE, "nodes", 3), first, 1, reason="refill") == 1  # empties the GPU lease
    assert (await unit_sizes(pg_dsn))[second] == (0, "nodes")
    await lost.client.hset(lost.keys.counter(sensitive_lease(second)), mapping={"size": 8, "unit": "gpus"})  # the emptying lost...
    await lost.client.set(lost.sequence, seq)  # ...with the sequence it advanced

    tenants = [second, *(t for t in TENANTS if t != second)][:4]
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=sensitive_run(t, 0)) for t in tenants))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert sum(a.json()["decision"] == "ALLOW" for a in answers) == POOL // 8, [a.json().get("reason") for a in answers]
    assert await lost.generation() not in (None, generation)  # rebuilt
    await assert_leases_agree(server, pg_dsn)


async def test_a_shard_that_lost_a_return_of_its_tenants_lease_is_rebuilt_before_it_decides(admission_factory, pg_dsn) -> None:
    """A replica promoted before it had a lease's shrinking: its tenant's lease of the sensitive
    pool is larger there than Postgres's, and its sequence is behind the return's, which Postgres
    recorded. Deciding on it would let two tenants hold 32 GPUs of a pool of 24; the shard is
    rebuilt with Postgres's sizes first, and exactly three 8-GPU runs are admitted."""
    server = await started(admission_factory, pg_dsn)
    escrow, book = server.rt.admitter.escrow, CounterBook(SENSITIVE, "gpus", POOL)
    first, second = TENANTS[0], next(t for t in TENANTS if server.rt.ledgers.of_root(t).shard != server.rt.ledgers.of_root(TENANTS[0]).shard)
    assert await escrow.grant(book, first, 16, reason="refill") == 16
    assert await escrow.grant(book, second, 8, reason="refill") == 8
    lost = server.rt.ledgers.of_root(first)
    seq, generation = int(await lost.client.get(lost.sequence)), await lost.generation()
    assert await escrow.give_back(book, first, 8, reason="idle") == 8
    assert await escrow.grant(book, second, 8, reason="refill") == 8  # what it gave back, granted to the other tenant
    await lost.client.hset(lost.keys.counter(sensitive_lease(first)), "size", 16)  # the shrinking lost...
    await lost.client.set(lost.sequence, seq)  # ...with the sequence it advanced

    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=sensitive_run(t, n)) for n in range(2) for t in (first, second)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    assert sum(a.json()["decision"] == "ALLOW" for a in answers) == POOL // 8, [a.json().get("reason") for a in answers]
    assert await lost.generation() not in (None, generation)  # rebuilt
    await assert_leases_agree(server, pg_dsn)


async def test_the_leases_command_shows_what_each_tenant_holds_of_the_pool_and_of_a_shared_budget(admission_factory, pg_dsn, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`budgetgate ledger leases` shows an operator every carved budget and the sensitive pool:
    the limit, what no lease holds, each tenant's lease and the moves made lately."""
    shared = budget_yaml("everyone", namespace="ml", labels="{}", limit="gpu_hours: 60")
    await apply_policies(pg_dsn, {**policies(), "sensitive.yaml": SENSITIVE_QUOTA, "shared.yaml": shared}, sha="9" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    for tenant in TENANTS[:2]:
        assert decision_of(await server.client.post("/v1/admissions", json=sensitive_run(tenant, 0))) == "ALLOW"
    shards = {"BUDGETGATE_LEDGER_SHARDS": str(SHARDS)}
    shown = await budgetgate_on(settings, "ledger", "leases", "--json", cwd=tmp_path, variables=shards)
    assert shown.returncode == 0, shown.stderr
    report = {carved["carved"]: carved for carved in json.loads(shown.stdout)}
    pool = report["counter:sensitive"]
    assert pool["limit"] == POOL and pool["unit"] == "gpus"
    assert {lease["root"]: lease["used"] for lease in pool["leases"]} == {TENANTS[0]: 8, TENANTS[1]: 8}
    assert pool["free"] == POOL - sum(lease["size"] for lease in pool["leases"]) and {m["reason"] for m in pool["moves"]} == {"refill"}
    [budget] = [carved for key, carved in report.items() if key != "counter:sensitive"]
    assert budget["limit"] == 60 * GPU_HOUR and {lease["root"]: lease["used"] for lease in budget["leases"]} == {t: 8 * GPU_HOUR for t in TENANTS[:2]}
    text = await budgetgate_on(settings, "ledger", "leases", cwd=tmp_path, variables=shards)
    assert text.returncode == 0 and f"counter:sensitive: limit {POOL} gpus" in text.stdout, text.stdout
    assert f"  {TENANTS[0]}: size " in text.stdout and "used 8 GPU-hours" in text.stdout, text.stdout
