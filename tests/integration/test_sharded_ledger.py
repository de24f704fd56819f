"""The Redis ledger sharded by tenant (BUDGETGATE_LEDGER_SHARDS=3, budgetgate.ledger.sharded), end
to end on real Postgres, Redis and Kafka: admission decides each tenant's submissions on its
tenant's shard and admits no more than each budget holds under concurrency; every key, run and
quota counter lives on its tenant's shard alone; a shard that lost its state is rebuilt alone
while the others keep their generation; the reconciler settles each run on its shard; the drift
check finds every shard clean; and a bundle a sharded ledger cannot enforce is refused with the
reason. A ledger suite: on a Redis Cluster the shards' tags hash to different slots."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.core.shards import SEQ_STEP, Shards
from budgetgate.ledger.queries import sql
from budgetgate.reports.whatif_report import what_if
from budgetgate.services.admission.admitter import Unavailable
from tests.support.accounts import account_budget, account_tree
from tests.support.admission import apply_policies, budget_yaml, held_in_postgres, one_batch, reserved_in_redis, submission
from tests.support.cli import budgetgate_on
from tests.support.reconciler import feed, lifecycle, reconciler_factory, usage, wait_caught_up  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

SHARDS = 3
TENANTS = [f"team-{i}" for i in range(6)]
GPU_HOUR = 3_600_000
QUOTA = """apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: quota-{tenant}}}
spec: {{tenant: {tenant}, max_gpus: 1000}}
"""


def policies() -> dict[str, str]:
    files = {f"{t}.yaml": budget_yaml(f"budget-{t}", namespace="ml", labels=f"{{team: {t}}}", limit="gpu_hours: 20") for t in TENANTS}
    return files | {f"quota-{t}.yaml": QUOTA.format(tenant=t) for t in TENANTS}


def run(tenant: str, n: int) -> dict[str, object]:
    return submission(
        run_id=f"{tenant}/run-{n}", namespace="ml", labels={"team": tenant}, resources={"gpus": 8, "nodes": 1}, projected_runtime_hours=1.0, job=None
    )


async def held_in_redis(server) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What Redis holds reserved, by ledger key, every shard's, as held_in_postgres lists it (keys
    holding nothing left out: a lease whose every decision was refused is still loaded)."""
    return {key: reserved for key, reserved in (await reserved_in_redis(server)).items() if reserved}


async def ledger_figures(dsn: str) -> dict[str, tuple[int, int]]:
    """Postgres's (reserved, consumed) of every ledger key."""
    conn = await asyncpg.connect(dsn)
    try:
        return {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in await conn.fetch(sql("all_ledger_figures"))}
    finally:
        await conn.close()


async def sharded_admission(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    await apply_policies(pg_dsn, policies(), sha="5" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    return server


async def test_each_tenant_is_decided_on_its_shard_and_no_budget_is_overadmitted(admission_factory, pg_dsn) -> None:
    server = await sharded_admission(admission_factory, pg_dsn)
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=run(t, n)) for n in range(5) for t in TENANTS))
    allowed: dict[str, int] = defaultdict(int)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        body = answer.json()
        allowed[body["run_id"].split("/")[0]] += body["decision"] == "ALLOW"
    assert allowed == {t: 2 for t in TENANTS}  # 8 GPU-hours each: two fit in 20, a third does not

    held = await held_in_postgres(pg_dsn)
    assert await held_in_redis(server) == held
    shards = Shards("bg", SHARDS)
    for ledger in server.rt.ledgers:
        mine = [t for t in TENANTS if shards.of_root(t) == ledger.shard]
        keys = {k.decode().split(":l:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:l:*")}
        assert keys == {k for k in held if any(f"team={t}|" in k for t in mine)}, f"shard {ledger.shard} holds another tenant's keys"
        counters = {k.decode().split(":q:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:q:*")}
        assert counters == {f"t:{t}" for t in mine}
    assert {shards.of_root(t) for t in TENANTS} == set(range(SHARDS)), "the test's tenants should spread over every shard"

    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT labels ->> 'team' AS tenant, ledger_seq FROM decisions WHERE ledger_seq IS NOT NULL")
    finally:
        await conn.close()
    assert len(rows) == 12 and all(r["ledger_seq"] % SEQ_STEP == shards.of_root(r["tenant"]) for r in rows)


async def test_a_shard_that_lost_its_state_is_rebuilt_alone(admission_factory, pg_dsn) -> None:
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        assert (await server.client.post("/v1/admissions", json=run(t, 0))).json()["decision"] == "ALLOW"
    lost = server.rt.ledgers.of_root(TENANTS[0])
    before = {ledger.shard: await ledger.generation() for ledger in server.rt.ledgers}
    await lost.client.delete(*[k async for k in lost.client.scan_iter(match=f"{lost.tag}:*")])  # a flushed shard

    assert (await server.client.post("/v1/admissions", json=run(TENANTS[0], 1))).json()["decision"] == "ALLOW"
    after = {ledger.shard: await ledger.generation() for ledger in server.rt.ledgers}
    assert after[lost.shard] not in (None, before[lost.shard])  # rebuilt
    assert {s: g for s, g in after.items() if s != lost.shard} == {s: g for s, g in before.items() if s != lost.shard}  # the others kept theirs
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_the_reconciler_settles_each_run_on_its_shard(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        for n in range(2):
            assert (await server.client.post("/v1/admissions", json=run(t, n))).json()["decision"] == "ALLOW"
    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    start = datetime.now(UTC) - timedelta(minutes=40)
    for t in TENANTS:  # run 0 ran half an hour on its 8 GPUs and completed; run 1 started a minute ago
        await feed.send(
            lifecycle(f"{t}/run-0", "STARTED", start, gpus=8), usage(f"{t}/run-0", "s1", start + timedelta(minutes=30), gpu_hours=4.0),
            lifecycle(f"{t}/run-0", "COMPLETED", start + timedelta(minutes=30)),
            lifecycle(f"{t}/run-1", "STARTED", datetime.now(UTC) - timedelta(minutes=1), gpus=8),
        )  # fmt: skip
    await wait_caught_up(reconciler)

    figures = await ledger_figures(pg_dsn)
    assert set(figures.values()) == {(8 * GPU_HOUR, 4 * GPU_HOUR)}  # run 1 holds its 8; run 0 consumed 4
    for t in TENANTS:
        ledger = server.rt.ledgers.of_root(t)
        [key] = [k for k in figures if f"team={t}|" in k]
        assert await ledger.readings([key]) == {key: figures[key]}
        assert int(await ledger.client.hget(ledger.keys.counter(f"t:{t}"), "gpus")) == 8  # run 0 gave its GPUs back
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def test_a_bundle_a_sharded_ledger_cannot_enforce_is_refused_with_the_reason(admission_factory, pg_dsn) -> None:
    sensitive = "apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {id: sensitive}\nspec: {sensitive_pool_size: 16}\n"
    await apply_policies(pg_dsn, {**policies(), "sensitive.yaml": sensitive}, sha="6" * 40)
    server = await admission_factory(ledger_shards=SHARDS)

    async def refused() -> bool:
        return "cannot be enforced on 3 shards" in (await server.client.get("/readyz")).text

    await wait_for(refused, what="readiness to name the bundle a sharded ledger cannot enforce")
    answer = await server.client.post("/v1/admissions", json=run(TENANTS[0], 0))
    assert answer.status_code == 503
    assert "the sensitive-workload quota is shared by tenants: a sharded ledger has none yet" in answer.text, answer.text
    assert await held_in_postgres(pg_dsn) == {}


async def test_the_ledger_commands_go_shard_by_shard(admission_factory, pg_dsn, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        assert (await server.client.post("/v1/admissions", json=run(t, 0))).json()["decision"] == "ALLOW"
    await server.stop()  # nothing else may rebuild Redis behind the commands' backs
    shards = {"BUDGETGATE_LEDGER_SHARDS": str(SHARDS)}
    lost = server.rt.ledgers.of_root(TENANTS[0])
    await lost.client.delete(lost.marker)

    # Keys a former number of shards left: one shard's tag, and a fifth shard's.
    prefix = settings.redis_prefix
    for former in ("{" + prefix + "}", "{" + prefix + ":4}"):
        await lost.client.hset(f"{former}:l:old", mapping={"reserved": 1, "consumed": 0})
        await lost.client.set(f"{former}:seq", 7)

    check = await budgetgate_on(settings, "ledger", "check", cwd=tmp_path, variables=shards)
    assert check.returncode == 1 and f"does not hold the ledger on shard {lost.shard} " in check.stdout, check
    rebuilt = await budgetgate_on(settings, "ledger", "rebuild-redis", cwd=tmp_path, variables=shards)
    assert rebuilt.returncode == 0 and "(3 shards): 6 ledger key(s), 6 run(s)" in rebuilt.stdout, rebuilt
    assert "deleted 4 key(s) under the tags of a former number of shards" in rebuilt.stdout, rebuilt
    left = [k async for k in lost.client.scan_iter(match="{" + prefix + "*")]
    assert left and all(k.decode().startswith(tuple(ledger.tag for ledger in server.rt.ledgers)) for k in left)
    key = next(iter(await server.rt.ledgers.of_root(TENANTS[1]).all_readings()))
    await server.rt.ledgers.of_root(TENANTS[1]).consume({key: 1_000})  # a drift on one shard
    released = server.rt.ledgers.of_root(TENANTS[2])
    await released.release(f"{TENANTS[2]}/run-0")  # a run's hold lost on another shard
    drifted = await budgetgate_on(settings, "ledger", "check", cwd=tmp_path, variables=shards)
    assert drifted.returncode == 1, drifted
    by_shard: dict[int, list[str]] = defaultdict(list)  # each shard's lines, under its heading
    section = -1
    for line in drifted.stdout.splitlines():
        if line.startswith("shard "):
            section = int(line.split()[1].rstrip(":"))
        else:
            by_shard[section].append(line)
    assert any(line.startswith(f"ledger key {key}:") for line in by_shard[server.rt.ledgers.of_root(TENANTS[1]).shard]), drifted.stdout
    # The run is reported once, by its own shard's check (each shard looks at its runs alone).
    runs = [(shard, line) for shard, lines in by_shard.items() for line in lines if line.startswith("run ")]
    assert len(runs) == 1 and runs[0][0] == released.shard, drifted.stdout
    assert runs[0][1].startswith(f"run {TENANTS[2]}/run-0: Redis holds {{}}, Postgres {{"), drifted.stdout


async def test_a_batch_spanning_shards_reserves_on_each_with_one_script_per_shard(admission_factory, pg_dsn) -> None:
    """Submissions of every tenant decided as ONE batch of the admitter: one Postgres round trip
    takes every shard's lock and reads each one's committed sequence, each shard reserves its
    tenants' submissions in one script, and every budget ends holding what its tenant's ALLOWs
    reserved, on its shard and in Postgres."""
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:  # each budget's key loaded on its shard (a key never loaded takes a second script)
        assert (await server.client.post("/v1/admissions", json=run(t, 0))).json()["decision"] == "ALLOW"
    reserves: dict[int, int] = defaultdict(int)
    for ledger in server.rt.ledgers:
        real = ledger.reserve_batch

        async def counted(batch, *, now_ms, committed_seq, _real=real, _shard=ledger.shard):  # type: ignore[no-untyped-def]
            reserves[_shard] += 1
            return await _real(batch, now_ms=now_ms, committed_seq=committed_seq)

        ledger.reserve_batch = counted  # type: ignore[method-assign]
    answers = await one_batch(server, [run(t, n) for n in (1, 2) for t in TENANTS])
    assert [a["decision"] for a in answers] == ["ALLOW"] * 6 + ["DENY"] * 6  # 8 + 8 of 20, then 24 > 20
    assert dict(reserves) == {shard: 1 for shard in range(SHARDS)}  # every shard once, in one batch
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn) and len(await held_in_postgres(pg_dsn)) == len(TENANTS)


async def test_a_shard_failing_in_a_batch_fails_no_other_shards_decision(admission_factory, pg_dsn) -> None:
    """One batch of every tenant's submissions while one shard is at fault: the other shards'
    decisions commit and are answered in that batch. A shard that lost its state is rebuilt and
    its submissions decided right after; an unreachable one's are answered 503 (the client tries
    again), nothing of them recorded, and its shard is invalidated, to be rebuilt from Postgres."""
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:  # each budget's key loaded on its shard
        assert (await server.client.post("/v1/admissions", json=run(t, 0))).json()["decision"] == "ALLOW"
    struck = server.rt.ledgers.of_root(TENANTS[0])
    hit = {t for t in TENANTS if server.rt.ledgers.of_root(t) is struck}

    await struck.client.delete(struck.marker)  # lost its state
    answers = await one_batch(server, [run(t, 1) for t in TENANTS])
    assert [a["decision"] for a in answers] == ["ALLOW"] * len(TENANTS)
    assert await struck.is_loaded()

    real = struck.reserve_batch

    async def unreachable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("the shard's master is gone")

    struck.reserve_batch = unreachable  # type: ignore[method-assign]
    try:
        answers = await one_batch(server, [run(t, 2) for t in TENANTS])
    finally:
        struck.reserve_batch = real  # type: ignore[method-assign]
    for t, answer in zip(TENANTS, answers, strict=True):
        if t in hit:
            assert isinstance(answer, Unavailable) and "the shard's master is gone" in str(answer)
        else:
            assert answer["decision"] == "DENY"  # 24 > 20: decided, on its own shard
    conn = await asyncpg.connect(pg_dsn)
    try:
        decided = {r["run_id"] for r in await conn.fetch("SELECT run_id FROM decisions WHERE run_id LIKE '%/run-2'")}
    finally:
        await conn.close()
    assert decided == {f"{t}/run-2" for t in TENANTS if t not in hit}

    async def matches() -> bool:
        return await struck.is_loaded() and await reserved_in_redis(server) == await held_in_postgres(pg_dsn)

    await wait_for(matches, what="the struck shard rebuilt and Redis holding what Postgres holds")


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
    await feed.send(
        lifecycle(f"{tenant}/run-{n}", "STARTED", start, gpus=8), usage(f"{tenant}/run-{n}", "s1", start + timedelta(minutes=30), gpu_hours=4.0),
        lifecycle(f"{tenant}/run-{n}", "COMPLETED", start + timedelta(minutes=30)),
    )  # fmt: skip
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
        assert (await server.client.post("/v1/admissions", json=run(a, n))).json()["decision"] == "ALLOW"
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
    assert (await server.client.post("/v1/admissions", json=run(tenant, 0))).json()["decision"] == "ALLOW"
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
