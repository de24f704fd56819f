"""Budgets tenants share on the Redis ledger sharded by tenant (BUDGETGATE_LEDGER_SHARDS=3), end to
end on real Postgres, Redis and Kafka: each tenant reserves on its own escrow lease of such a
budget (scoped by namespace, or attached to an account; over a calendar or a rolling window),
refilled from what no lease holds and from room idle in other leases before a decision is
refused; the leases together never exceed the limit; the reconciler settles on the leases;
what-if reads a leased budget whole. A ledger suite: on a Redis Cluster the shards' tags hash to
different slots."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from budgetgate.core.escrow import lease_key as escrow_lease_key
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.ledger.escrow_leases import BudgetBook
from budgetgate.reports.whatif_report import what_if
from budgetgate.services.admission.admitter import Unavailable
from tests.support.accounts import account_budget, account_tree
from tests.support.admission import apply_policies, budget_yaml, decision_of, held_in_postgres, one_batch, submission
from tests.support.reconciler import feed, lifecycle, reconciler_factory, usage, wait_caught_up  # noqa: F401 - pytest fixtures
from tests.support.sharded import GPU_HOUR, SHARDS, TENANTS, held_in_redis, ledger_figures, policies, ran_half_an_hour, run
from tests.support.waiting import wait_for


SHARED_LIMIT = 60  # GPU-hours of the budget every tenant shares; each tenant's own holds 20


async def test_a_budget_tenants_share_is_charged_through_each_tenants_escrow_lease(
    admission_factory,
    reconciler_factory,
    feed,
    pg_dsn,  # noqa: F811
) -> None:
    """A budget scoped by namespace alone covers every tenant's runs: each tenant reserves on its
    own escrow lease of it, on its own shard, in the one script of its decision; a lease that
    lacks room is refilled once from what no lease holds before the decision is refused. Under
    concurrent submissions of six tenants on three shards the shared budget admits no more than
    its limit, the leases together never exceed it, Redis holds what Postgres holds, and the
    reconciler settles a run's usage on its tenant's lease."""
    shared = budget_yaml("everyone", namespace="ml", labels="{}", limit=f"gpu_hours: {SHARED_LIMIT}")
    await apply_policies(pg_dsn, {**policies(), "shared.yaml": shared}, sha="7" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()

    quoted = (await server.client.post("/v1/quotes", json=run(TENANTS[0], 0))).json()
    assert quoted["decision"] == "ALLOW", quoted  # its lease empty, but a refill would grant what it lacks
    first = (await server.client.post("/v1/admissions", json=run(TENANTS[0], 0))).json()
    assert first["decision"] == "ALLOW", first  # its lease was empty: refilled, then reserved on
    explained = (await server.client.get(f"/v1/admissions/{TENANTS[0]}/run-0/explain")).json()
    assert explained["identical"] is True, explained
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=run(t, n)) for n in range(1, 3) for t in TENANTS))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    bodies = [first, *(a.json() for a in answers)]
    denied = next(b for b in bodies if b["decision"] != "ALLOW")
    explained = (await server.client.get(f"/v1/admissions/{denied['run_id']}/explain")).json()
    assert explained["identical"] is True, explained  # decided on its lease after the refill
    tenant_of_denied, _ = denied["run_id"].split("/run-")
    again = (await server.client.post("/v1/quotes", json=run(tenant_of_denied, 9))).json()
    assert again["decision"] == denied["decision"], (again, denied)  # nothing free: a refill would not help
    allowed = [b for b in bodies if b["decision"] == "ALLOW"]
    assert 1 <= len(allowed) and 8 * len(allowed) <= SHARED_LIMIT  # 8 GPU-hours each: at most 7 of 13

    held = await held_in_postgres(pg_dsn)
    assert await held_in_redis(server) == held
    leases = {k: v for k, v in held.items() if "@" in k}
    assert sum(leases.values()) == 8 * GPU_HOUR * len(allowed) and not any(k.startswith("ns=ml|") for k in held)
    for key in leases:  # on its tenant's shard, and only there
        tenant = key.split("@", 1)[1].split("|", 1)[0]
        for ledger in server.rt.ledgers:
            assert (key in await ledger.readings([key])) == (ledger.shard == server.rt.ledgers.of_root(tenant).shard)
    conn = await asyncpg.connect(pg_dsn)
    try:
        sizes = {r["root"]: r["size"] for r in await conn.fetch("SELECT root, size FROM escrow_leases")}
        refills = await conn.fetchval("SELECT count(*) FROM escrow_moves WHERE kind = 'grant' AND reason = 'refill'")
    finally:
        await conn.close()
    assert sum(sizes.values()) <= SHARED_LIMIT * GPU_HOUR and refills >= 1
    assert all(leases.get(k, 0) <= sizes[k.split("@", 1)[1].split("|", 1)[0]] for k in leases)
    for ledger in server.rt.ledgers:  # Redis's sizes are Postgres's
        for key in [k for k in leases if ledger.owns_key(k)]:
            assert int(await ledger.client.hget(ledger.ledger(key), "size")) == sizes[key.split("@", 1)[1].split("|", 1)[0]]

    unnamed = submission(run_id="nobody/run-0", namespace="ml", labels={}, resources={"gpus": 1}, projected_runtime_hours=1.0, job=None)
    refused = await server.client.post("/v1/admissions", json=unnamed)
    assert refused.status_code == 422 and "must name its tenant in label 'team'" in refused.text, refused.text

    tenant, n = allowed[0]["run_id"].split("/run-")
    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    start = datetime.now(UTC) - timedelta(minutes=40)
    await feed.send(*ran_half_an_hour(f"{tenant}/run-{n}", start))
    await wait_caught_up(reconciler)
    figures = await ledger_figures(pg_dsn)
    [lease] = [k for k in figures if k.split("|", 1)[0].endswith(f"@{tenant}")]
    assert figures[lease][1] == 4 * GPU_HOUR  # the run's usage, on its tenant's lease
    assert await server.rt.ledgers.of_root(tenant).readings([lease]) == {lease: figures[lease]}
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def test_budgets_attached_to_accounts_are_charged_through_each_tenants_leases_all_or_none(admission_factory, pg_dsn) -> None:
    """A budget attached to an account covers the runs of every tenant below it: on a sharded
    ledger each tenant reserves on its own lease of it, and a run under two budgeted accounts
    (alice under research) reserves on both of its tenant's leases in its one script, all or
    none. Runs of two tenants on two shards, submitted at once, admit no more than either budget
    holds, and nothing is held for a refused run."""
    tree = account_tree() + account_budget("research-month", "research", 24) + account_budget("alice-month", "alice", 10)
    await apply_policies(pg_dsn, {"accounts.yaml": tree}, sha="8" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    assert server.rt.ledgers.of_root("vision") is not server.rt.ledgers.of_root("nlp")  # two shards

    def account_run(run_id: str, namespace: str, **labels: str) -> dict[str, object]:
        return submission(run_id=run_id, namespace=namespace, labels=labels, resources={"gpus": 4, "nodes": 1}, projected_runtime_hours=1.0, job=None)

    runs = [
        *(account_run(f"alice-{n}", "vision", team="vision", user="alice") for n in range(3)),
        *(account_run(f"bob-{n}", "vision", team="vision", user="bob") for n in range(3)),
        *(account_run(f"nlp-{n}", "nlp", team="nlp") for n in range(3)),
    ]
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=r) for r in runs))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    bodies = [a.json() for a in answers]
    allowed = [b["run_id"] for b in bodies if b["decision"] == "ALLOW"]
    alice = [r for r in allowed if r.startswith("alice-")]
    assert 1 <= len(alice) and 4 * len(alice) <= 10 and 4 * len(allowed) <= 24, bodies
    for body in bodies:
        charged = {e["policy_id"] for e in body["evaluations"]}
        assert charged == ({"research-month", "alice-month"} if body["run_id"].startswith("alice-") else {"research-month"}), body

    held = await held_in_postgres(pg_dsn)
    assert await held_in_redis(server) == held
    assert not any(k.startswith("account=research|") or k.startswith("account=alice|") for k in held)  # only leases hold
    on_research = {k: v for k, v in held.items() if k.startswith("account=research@")}
    on_alice = {k: v for k, v in held.items() if k.startswith("account=alice@")}
    assert sum(on_research.values()) == 4 * GPU_HOUR * len(allowed) and sum(on_alice.values()) == 4 * GPU_HOUR * len(alice)
    for key in [*on_research, *on_alice]:  # on its tenant's shard, and only there
        tenant = key.split("@", 1)[1].split("|", 1)[0]
        for ledger in server.rt.ledgers:
            assert (key in await ledger.readings([key])) == (ledger.shard == server.rt.ledgers.of_root(tenant).shard)
    conn = await asyncpg.connect(pg_dsn)
    try:
        sizes = {(r["ledger_key"].split("|", 1)[0], r["root"]): r["size"] for r in await conn.fetch("SELECT ledger_key, root, size FROM escrow_leases")}
    finally:
        await conn.close()
    assert sum(v for (budget, _), v in sizes.items() if budget == "account=research") <= 24 * GPU_HOUR
    assert sum(v for (budget, _), v in sizes.items() if budget == "account=alice") <= 10 * GPU_HOUR

    denied = next((b for b in bodies if b["decision"] != "ALLOW" and b["run_id"].startswith("alice-")), None) or next(
        b for b in bodies if b["decision"] != "ALLOW"
    )
    explained = (await server.client.get(f"/v1/admissions/{denied['run_id']}/explain")).json()
    assert explained["identical"] is True, explained
    unnamed = (await server.client.post("/v1/admissions", json=account_run("nlp-x", "nlp"))).json()
    assert "must name its tenant in label 'team'" in str(unnamed), unnamed


async def test_a_budget_tenants_share_over_a_rolling_window_ages_out_of_each_tenants_lease(
    admission_factory,
    reconciler_factory,
    feed,
    pg_dsn,  # noqa: F811
) -> None:
    """A rolling-window budget tenants share: a tenant's run reserves on its lease, its usage is
    settled on the lease in hour buckets, and as the window moves on the usage ages out of the
    lease (Postgres and the lease's shard alike), which leaves the lease room it can hold again
    or give back; the drift check finds every shard clean."""
    from budgetgate.services.reconciler import budget_actions

    rolling = budget_yaml("everyone-daily", namespace="ml", labels="{}", limit="gpu_hours: 100", window="{rolling_days: 1}")
    await apply_policies(pg_dsn, {**policies(), "rolling.yaml": rolling}, sha="9" * 40)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    tenant = TENANTS[0]
    first = (await server.client.post("/v1/admissions", json=run(tenant, 0))).json()
    assert first["decision"] == "ALLOW", first
    held = await held_in_postgres(pg_dsn)
    [lease] = [k for k in held if k.startswith(f"ns=ml@{tenant}|rolling-1d|")]
    assert held[lease] == 8 * GPU_HOUR

    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    now = datetime.now(UTC)
    start = now - timedelta(hours=20)
    await feed.send(
        lifecycle(f"{tenant}/run-0", "STARTED", start, gpus=8), usage(f"{tenant}/run-0", "1", start + timedelta(hours=1), 6.0),
        usage(f"{tenant}/run-0", "2", start + timedelta(hours=3), 10.0), lifecycle(f"{tenant}/run-0", "COMPLETED", start + timedelta(hours=3)),
    )  # fmt: skip

    async def settled() -> bool:
        return (await ledger_figures(pg_dsn)).get(lease) == (0, 10 * GPU_HOUR)

    await wait_for(settled, what="the run's usage on its tenant's lease of the rolling budget")
    shard = server.rt.ledgers.of_root(tenant)
    # Six hours on, the first sample's hour has left the window; two more hours on, all of it.
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=6)) == {lease: 6 * GPU_HOUR}
    figures = await ledger_figures(pg_dsn)
    assert figures[lease] == (0, 4 * GPU_HOUR) and await shard.readings([lease]) == {lease: figures[lease]}
    assert await budget_actions.age_rolling(reconciler.pool, reconciler.ledgers, now=now + timedelta(hours=8)) == {lease: 4 * GPU_HOUR}
    figures = await ledger_figures(pg_dsn)
    assert figures[lease] == (0, 0) and await shard.readings([lease]) == {lease: (0, 0)}
    for other in server.rt.ledgers:
        assert other is shard or await other.readings([lease]) == {}  # on its tenant's shard alone
    again = (await server.client.post("/v1/admissions", json=run(tenant, 1))).json()
    assert again["decision"] == "ALLOW", again  # the room the usage left is the lease's again
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def test_what_if_reads_a_budget_tenants_share_as_its_leases_together(admission_factory, pg_dsn) -> None:
    """What-if of a bundle with a budget tenants share, over decisions a sharded ledger made on
    its tenants' leases: the candidate's budget starts from every lease's figures together, those
    of a lease no decision of the period read included (team-0 reserved 16 of 20 GPU-hours before
    the period; team-1, on another shard, was refused 8 in it). A candidate limit of 23 refuses
    team-1 too; 24 admits it."""

    def bundle_files(limit: int) -> dict[str, str]:
        return {**policies(), "shared.yaml": budget_yaml("everyone", namespace="ml", labels="{}", limit=f"gpu_hours: {limit}")}

    await apply_policies(pg_dsn, bundle_files(20), sha="a1" * 20)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    a, b = TENANTS[0], TENANTS[1]
    assert server.rt.ledgers.of_root(a) is not server.rt.ledgers.of_root(b)
    for n in range(2):
        assert decision_of(await server.client.post("/v1/admissions", json=run(a, n))) == "ALLOW"
    since = datetime.now(UTC)
    refused = (await server.client.post("/v1/admissions", json=run(b, 0))).json()
    assert refused["decision"] == "DENY" and "everyone" in refused["reason"], refused  # 16 + 8 > 20

    conn = await asyncpg.connect(pg_dsn)
    try:
        outcomes = {}
        for limit in (23, 24):
            documents = [doc for name, text in bundle_files(limit).items() for doc in parse_text(text, name)]
            outcomes[limit] = await what_if(conn, build_bundle(documents, git_sha="b2" * 20), since)
    finally:
        await conn.close()
    assert outcomes[23]["decisions"] == 1 and outcomes[23]["flips"] == [], outcomes[23]
    assert [(f["run_id"], f["before"], f["after"]) for f in outcomes[24]["flips"]] == [(f"{b}/run-0", "DENY", "ALLOW")], outcomes[24]


async def test_usage_in_a_window_a_leased_run_did_not_reserve_in_opens_its_tenants_lease_of_that_window(
    admission_factory,
    reconciler_factory,
    feed,
    pg_dsn,  # noqa: F811
) -> None:
    """A run admitted today on its tenant's lease of a daily budget tenants share, whose usage
    began before midnight: the reconciler files the usage of yesterday on the tenant's lease of
    yesterday's window, which it opens (size 0, beside the budget's entry of that window) on
    the tenant's shard; today's usage goes to today's lease, and both agree in Redis and Postgres."""
    daily = budget_yaml("everyone-day", namespace="ml", labels="{}", limit="gpu_hours: 100", window="{calendar: day}")
    await apply_policies(pg_dsn, {**policies(), "daily.yaml": daily}, sha="c3" * 20)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    tenant = TENANTS[4]
    assert decision_of(await server.client.post("/v1/admissions", json=run(tenant, 0))) == "ALLOW"
    [today] = [k for k in await held_in_postgres(pg_dsn) if k.startswith(f"ns=ml@{tenant}|")]

    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = midnight - timedelta(hours=1)
    await feed.send(
        lifecycle(f"{tenant}/run-0", "STARTED", start, gpus=8), usage(f"{tenant}/run-0", "1", midnight - timedelta(minutes=30), 4.0),
        usage(f"{tenant}/run-0", "2", midnight, 6.0), lifecycle(f"{tenant}/run-0", "COMPLETED", midnight),
    )  # fmt: skip
    await wait_caught_up(reconciler)

    async def settled() -> bool:
        return (await ledger_figures(pg_dsn)).get(today, (None, None))[0] == 0

    await wait_for(settled, what="the run settled")
    figures = await ledger_figures(pg_dsn)
    [yesterday] = [k for k in figures if k.startswith(f"ns=ml@{tenant}|") and k != today]
    assert figures[yesterday] == (0, 4 * GPU_HOUR) and figures[today] == (0, 2 * GPU_HOUR), figures
    shard = server.rt.ledgers.of_root(tenant)
    assert await shard.readings([yesterday, today]) == {yesterday: figures[yesterday], today: figures[today]}
    conn = await asyncpg.connect(pg_dsn)
    try:
        opened = await conn.fetchrow("SELECT ledger_key, root, size FROM escrow_leases WHERE lease_key = $1", yesterday)
    finally:
        await conn.close()
    assert opened is not None and (opened["root"], opened["size"]) == (tenant, 0)
    assert opened["ledger_key"] in figures and opened["ledger_key"].split("|")[1] == yesterday.split("|")[1]  # the budget's entry of that window
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def test_submissions_of_one_tenant_lacking_room_on_its_lease_together_are_refilled_for_all_of_them(admission_factory, pg_dsn) -> None:
    """Three submissions of one tenant in one batch, its lease of a budget tenants share empty
    and the budget with room for all: each is refused by the lease alone, and their one refill
    grows the lease by what they lack together, so all three are admitted. A refill that asked
    only for what one of them lacked left the others refused while the budget had room."""
    shared = budget_yaml("everyone", namespace="ml", labels="{}", limit="gpu_hours: 100")
    await apply_policies(pg_dsn, {**policies(), "shared.yaml": shared}, sha="d4" * 20)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    tenant = TENANTS[3]
    answers = await one_batch(server, [run(tenant, n) for n in range(3)])  # 24 GPU-hours, over the tenant's own 20
    assert [a["decision"] for a in answers] == ["ALLOW", "ALLOW", "DENY"], answers
    assert "budget-team-3" in answers[2]["reason"], answers[2]  # its own budget refused the third, not the lease
    other = TENANTS[4]
    answers = await one_batch(server, [run(other, n) for n in range(2)] + [run(TENANTS[5], n) for n in range(2)])
    assert [a["decision"] for a in answers] == ["ALLOW"] * 4, answers
    held = await held_in_postgres(pg_dsn)
    assert await held_in_redis(server) == held
    assert sum(v for k, v in held.items() if k.startswith("ns=ml@")) == 6 * 8 * GPU_HOUR

    # A refill that fails answers the submissions that asked for it 503, and theirs alone.
    escrow, real = server.rt.admitter.escrow, server.rt.admitter.escrow.refill

    async def failing(budget, root, **kwargs):  # type: ignore[no-untyped-def]
        if root == TENANTS[0]:
            raise ConnectionError("Postgres went away")
        return await real(budget, root, **kwargs)

    escrow.refill = failing  # type: ignore[method-assign]
    try:
        answers = await one_batch(server, [run(TENANTS[0], 0), run(TENANTS[0], 1), run(TENANTS[1], 0)])
    finally:
        escrow.refill = real  # type: ignore[method-assign]
    assert all(isinstance(a, Unavailable) and "Postgres went away" in str(a) for a in answers[:2]), answers
    assert answers[2]["decision"] == "ALLOW", answers[2]
    assert await held_in_redis(server) == await held_in_postgres(pg_dsn)


async def test_a_reclaim_whose_shrink_lost_its_reply_invalidates_the_shard_it_shrank(admission_factory, pg_dsn) -> None:
    """A refill that reclaims idle room from another tenant's lease, on another shard, shrinks
    that lease in Redis first. Should the shrink's reply be lost (the script ran), the reclaim's
    transaction fails and Postgres keeps the lease's size: the giver's shard is invalidated, its
    lock still held, and rebuilt with Postgres's size before it decides again. Only the taker's
    shard was invalidated before, leaving the giver's lease smaller in Redis than in Postgres."""
    shared = budget_yaml("everyone", namespace="ml", labels="{}", limit="gpu_hours: 40")
    await apply_policies(pg_dsn, {**policies(), "shared.yaml": shared}, sha="d5" * 20)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    ledgers, escrow = server.rt.ledgers, server.rt.admitter.escrow
    taker = TENANTS[0]
    giver = next(t for t in TENANTS if ledgers.of_root(t).shard != ledgers.of_root(taker).shard)
    assert decision_of(await server.client.post("/v1/admissions", json=run(taker, 0))) == "ALLOW"
    budget = await server.rt.pool.fetchval("SELECT ledger_key FROM ledger_entries WHERE ledger_key LIKE 'ns=ml|%'")
    assert await escrow.grant(budget, giver, 10**12, reason="refill") > 0  # every free GPU-hour, idle in the giver's lease
    giving = ledgers.of_root(giver)
    lease = escrow_lease_key(budget, giver)
    in_postgres = await server.rt.pool.fetchval("SELECT size FROM escrow_leases WHERE lease_key = $1", lease)
    real = giving.move_lease

    async def reply_lost(*args, **kwargs):  # type: ignore[no-untyped-def]
        await real(*args, **kwargs)
        raise ConnectionError("the shrink's reply was lost")

    giving.move_lease = reply_lost  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionError, match="reply was lost"):
            await escrow._reclaim(BudgetBook(budget), taker, 4 * GPU_HOUR)
    finally:
        giving.move_lease = real  # type: ignore[method-assign]
    assert await server.rt.pool.fetchval("SELECT size FROM escrow_leases WHERE lease_key = $1", lease) == in_postgres
    assert not await giving.is_loaded()  # invalidated: its Redis lease shrank, Postgres's did not
    await ledgers.sync_of(giving).ensure_loaded()
    assert int(await giving.client.hget(giving.ledger(lease), "size")) == in_postgres
    assert all([(await sync.check_drift(repair=False)).clean for sync in ledgers.syncs])
