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
import redis.exceptions

from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.core.shards import SEQ_STEP, Shards
from budgetgate.ledger.queries import sql
from budgetgate.services.admission.admitter import Unavailable
from tests.support.admission import apply_policies, decision_of, held_in_postgres, one_batch, reserved_in_redis
from tests.support.cli import budgetgate_on
from tests.support.quotas import POOLS
from tests.support.sharded import (
    GPU_HOUR,
    SHARDS,
    TENANTS,
    each_shard_holds_its_tenants_alone,
    held_in_redis,
    ledger_figures,
    organisations_yaml,
    ran_half_an_hour,
    policies,
    run,
    sharded_admission,
)
from tests.support.reconciler import feed, lifecycle, reconciler_factory, usage, wait_caught_up  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for


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
    await each_shard_holds_its_tenants_alone(server, held, shards)
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
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
    lost = server.rt.ledgers.of_root(TENANTS[0])
    before = {ledger.shard: await ledger.generation() for ledger in server.rt.ledgers}
    await lost.client.delete(*[k async for k in lost.client.scan_iter(match=f"{lost.tag}:*")])  # a flushed shard

    assert decision_of(await server.client.post("/v1/admissions", json=run(TENANTS[0], 1))) == "ALLOW"
    after = {ledger.shard: await ledger.generation() for ledger in server.rt.ledgers}
    assert after[lost.shard] not in (None, before[lost.shard])  # rebuilt
    assert {s: g for s, g in after.items() if s != lost.shard} == {s: g for s, g in before.items() if s != lost.shard}  # the others kept theirs
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_the_reconciler_settles_each_run_on_its_shard(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        for n in range(2):
            assert decision_of(await server.client.post("/v1/admissions", json=run(t, n))) == "ALLOW"
    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    start = datetime.now(UTC) - timedelta(minutes=40)
    for t in TENANTS:  # run 0 ran half an hour on its 8 GPUs and completed; run 1 started a minute ago
        await feed.send(*ran_half_an_hour(f"{t}/run-0", start), lifecycle(f"{t}/run-1", "STARTED", datetime.now(UTC) - timedelta(minutes=1), gpus=8))
    await wait_caught_up(reconciler)

    figures = await ledger_figures(pg_dsn)
    assert set(figures.values()) == {(8 * GPU_HOUR, 4 * GPU_HOUR)}  # run 1 holds its 8; run 0 consumed 4
    for t in TENANTS:
        ledger = server.rt.ledgers.of_root(t)
        [key] = [k for k in figures if f"team={t}|" in k]
        assert await ledger.readings([key]) == {key: figures[key]}
        assert int(await ledger.client.hget(ledger.keys.counter(f"t:{t}"), "gpus")) == 8  # run 0 gave its GPUs back
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def test_token_pools_are_enforced_on_a_shard_of_their_own_and_a_run_takes_its_token_there(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    """On several shards a bundle with token pools is enforced: the pools' keys are on the shard
    of the empty root, so every allocation through the API is one script on one slot, and 60
    concurrent allocations of a pool of 5 grant exactly 5. A run asking a pool token in its
    decision takes it there first, then reserves on its tenant's shard (Admitter._take_tokens):
    12 runs of tenants on every shard racing for the 3 tokens left get exactly 3, each with its
    reservation, and the others hold nothing; a run its budget refuses gives its token back; a
    new attempt of a run holding its token is refused as taken; the run's end gives it back on
    the pools' shard; and a rebuild of that shard restores the runs' tokens."""
    await apply_policies(pg_dsn, {**policies(), "pools.yaml": POOLS.format(child=5, parent=8, cap=5)}, sha="6" * 40)
    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    url = "/v1/pools/snowflake:wh-1/allocations"
    answers = await asyncio.gather(*(server.client.post(url, json={"token": f"t-{i}"}) for i in range(60)))
    granted = [a.json()["token"] for a in answers if a.json()["status"] == "Granted"]
    assert len(granted) == 5 and (await server.client.get("/v1/pools/snowflake")).json()["used"] == 5
    pools = server.rt.ledgers.of_root("")
    for ledger in server.rt.ledgers:  # on the empty root's shard alone
        assert (await ledger.client.zcard(ledger.keys.pool("snowflake:wh-1")[0]) == 5) == (ledger.shard == pools.shard)
    for token in granted[:3]:
        assert (await server.client.delete(f"{url}/{token}")).json()["released"]

    token = {"pool_token": {"namespace": "snowflake:wh-1"}}
    racing = [{**run(t, n), **token} for n in range(2) for t in TENANTS]
    bodies = [a.json() for a in await asyncio.gather(*(server.client.post("/v1/admissions", json=r) for r in racing))]
    allowed = sorted(b["run_id"] for b in bodies if b["decision"] == "ALLOW")
    assert len(allowed) == 3, bodies
    assert all('token pool "snowflake:wh-1" is exhausted' in b["reason"] for b in bodies if b["decision"] != "ALLOW"), bodies
    assert len(await held_in_postgres(pg_dsn)) == len({r.split("/")[0] for r in allowed})  # a reservation for each run admitted alone
    assert await held_in_redis(server) == await held_in_postgres(pg_dsn)
    assert await _run_tokens(pg_dsn) == {f"run:{r}" for r in allowed}
    assert await pools.client.zcard(pools.keys.pool("snowflake:wh-1")[0]) == 5
    assert (await server.client.get("/v1/pools/snowflake")).json()["used"] == 5
    denied = next(b["run_id"] for b in bodies if b["decision"] != "ALLOW")
    for run_id in (allowed[0], denied):  # explain decides each again on what it was decided on: the same
        explained = (await server.client.get(f"/v1/admissions/{run_id}/explain")).json()
        assert explained["identical"] is True, explained

    # Room for one: a run its budget refuses (24 GPU-hours of 20) takes the token and gives it back.
    assert (await server.client.delete(f"{url}/{granted[3]}")).json()["released"]
    free = [t for t in TENANTS if not any(r.startswith(f"{t}/") for r in allowed)]  # (3 at least) holding nothing
    big = {**run(free[0], 9), "resources": {"gpus": 24, "nodes": 1}, **token}
    refused = (await server.client.post("/v1/admissions", json=big)).json()
    assert refused["decision"] == "DENY" and f"budget-{free[0]}" in refused["reason"], refused
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 4
    quoted = (await server.client.post("/v1/quotes", json={**run(free[0], 9), **token})).json()
    assert quoted["decision"] == "ALLOW", quoted
    # A quote of an admitted run finds the token its own. (A quote is a fresh evaluation: it counts
    # the run's own reservation against its budget too, so the run is one whose tenant won the race
    # once; with both of its runs admitted, 8 + 8 + 8 GPU-hours of 20 is refused by the budget.)
    alone = next(r for r in allowed if [a.split("/")[0] for a in allowed].count(r.split("/")[0]) == 1)
    holder = {**run(alone.split("/run-")[0], alone.split("/run-")[1]), **token}
    quoted = (await server.client.post("/v1/quotes", json=holder)).json()
    assert quoted["decision"] == "ALLOW", (quoted, allowed)
    # A run whose token another holder has (left by an allocation made before `run:` tokens were
    # reserved for submissions) is refused as taken, by its quote and its submission alike.
    leftover = (
        "INSERT INTO pool_allocations (namespace, token, levels, lease_expires_at, principal, state)"
        " VALUES ($1, $2, $3, now() + interval '1 hour', 'mallory', 'held')"
    )
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(leftover, "snowflake:wh-1", f"run:{free[1]}/run-9", ["snowflake:wh-1", "snowflake"])
    finally:
        await conn.close()
    await server.rt.ledgers.sync_of(pools).rebuild(force=True)
    taken = f'token "run:{free[1]}/run-9" of pool "snowflake:wh-1" is held by another holder, not by this run'
    assert (await server.client.post("/v1/quotes", json={**run(free[1], 9), **token})).json()["reason"] == taken
    assert (await server.client.post("/v1/admissions", json={**run(free[1], 9), **token})).json()["reason"] == taken
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 5
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("UPDATE pool_allocations SET state = 'released' WHERE principal = 'mallory'")
    finally:
        await conn.close()
    await server.rt.ledgers.sync_of(pools).rebuild(force=True)

    # The run ends: its token goes back on the pools' shard (its holds on its tenant's).
    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    ended = allowed[0]
    start = datetime.now(UTC) - timedelta(minutes=10)
    await feed.send(lifecycle(ended, "STARTED", start, gpus=8), lifecycle(ended, "COMPLETED", start + timedelta(minutes=5)))
    await wait_caught_up(reconciler)
    assert await _run_tokens(pg_dsn) == {f"run:{r}" for r in allowed[1:]}
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 3
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])

    # The pools' shard lost: rebuilt from Postgres, with the runs' tokens and the API's.
    await pools.client.delete(*[k async for k in pools.client.scan_iter(match=f"{pools.tag}:*")])
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 3
    assert [decision_of(await server.client.post("/v1/admissions", json={**run(t, 8), **token})) for t in free[:3]] == ["ALLOW", "ALLOW", "DENY"]
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_a_runs_token_left_by_a_process_that_died_before_its_write_is_given_back_by_the_drift_repair(admission_factory, pg_dsn) -> None:
    """A process that dies between a token's grant on the pools' shard and its batch's write
    leaves the token in Redis with no row in Postgres: the pool holds one token too many (never
    too few), until the reconciler's drift repair, which finds it and rebuilds the shard, or a
    retry of the run, which takes it over."""
    await apply_policies(pg_dsn, {**policies(), "pools.yaml": POOLS.format(child=1, parent=8, cap=5)}, sha="6" * 40)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    pools = server.rt.ledgers.of_root("")
    token = {"pool_token": {"namespace": "snowflake:wh-1"}}
    died = server.rt.admitter.prepare(AdmissionRequest.model_validate({**run(TENANTS[0], 0), **token}), datetime.now(UTC))
    assert died.asks.pool is not None and died.asks.pool_apart
    status, _, _ = await pools.allocate(died.asks.pool, now_ms=int(datetime.now(UTC).timestamp() * 1000))
    assert status == "GRANTED"  # ... and the process died: no decision, no row

    refused = (await server.client.post("/v1/admissions", json={**run(TENANTS[4], 0), **token})).json()
    assert refused["decision"] == "DENY" and 'token pool "snowflake:wh-1" is exhausted' in refused["reason"], refused
    drift = await server.rt.ledgers.sync_of(pools).check_drift(repair=True)
    assert drift is not None and drift.repaired and "snowflake:wh-1" in drift.pools, drift
    assert decision_of(await server.client.post("/v1/admissions", json={**run(TENANTS[4], 1), **token})) == "ALLOW"
    assert await _run_tokens(pg_dsn) == {f"run:{TENANTS[4]}/run-1"}
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def _run_tokens(dsn: str) -> set[str]:
    """The runs' pool tokens Postgres holds."""
    conn = await asyncpg.connect(dsn)
    try:
        return {r["token"] for r in await conn.fetch("SELECT token FROM pool_allocations WHERE state = 'held' AND run_id IS NOT NULL")}
    finally:
        await conn.close()


async def test_the_ledger_commands_go_shard_by_shard(admission_factory, pg_dsn, settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
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
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
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
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
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


async def test_scripts_whose_replies_were_lost_are_decided_once_their_shards_are_rebuilt(admission_factory, pg_dsn) -> None:
    """A Redis Cluster client that meets a slot no node serves (one master failing over) closes
    every connection it holds: the scripts in flight to the other masters ran, and their replies
    are lost. Their submissions are decided, not answered 503: the shards they may have left
    changed are invalidated and rebuilt from Postgres, and the batch tried once more. First one
    shard's reply is lost in a batch the others commit, then every shard's in one batch; each
    time every submission is decided, and Redis holds what Postgres holds (no reservation of a
    lost reply left behind)."""
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:  # each budget's key loaded on its shard
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
    ledgers = list(server.rt.ledgers)
    real = {ledger.shard: ledger.reserve_batch for ledger in ledgers}
    lost: list[int] = []

    def losing_its_reply(ledger):  # type: ignore[no-untyped-def]
        async def reserve_batch(batch, *, now_ms, committed_seq):  # type: ignore[no-untyped-def]
            await real[ledger.shard](batch, now_ms=now_ms, committed_seq=committed_seq)  # it ran
            ledger.reserve_batch = real[ledger.shard]  # once
            lost.append(ledger.shard)
            raise redis.exceptions.ConnectionError("Connection closed by server.")

        return reserve_batch

    try:
        for n, struck in ((1, [server.rt.ledgers.of_root(TENANTS[0])]), (2, ledgers)):
            for ledger in struck:
                ledger.reserve_batch = losing_its_reply(ledger)  # type: ignore[method-assign]
            answers = await one_batch(server, [run(t, n) for t in TENANTS])
            assert [a if isinstance(a, BaseException) else a["decision"] for a in answers] == ["ALLOW" if n == 1 else "DENY"] * len(TENANTS)
            assert sorted(lost) == sorted(ledger.shard for ledger in struck)
            lost.clear()
            assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn)
    finally:
        for ledger in ledgers:
            ledger.reserve_batch = real[ledger.shard]  # type: ignore[method-assign]


async def test_organisations_pinned_as_roots_bring_their_tenants_keys_onto_one_shard(
    admission_factory, reconciler_factory, feed, settings, pg_dsn, tmp_path
) -> None:  # noqa: F811
    """`budgetgate ledger roots --apply`: the account tree's organisations become the roots of the
    tenants it names. Refused while another session is connected; once applied, every shard is
    rebuilt, each tenant's keys (reservations held before included) sit on its organisation's
    shard alone, the admission started after it decides on them there, counting what was held,
    and the reconciler settles there."""
    server = await sharded_admission(admission_factory, pg_dsn)
    for t in TENANTS:
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 0))) == "ALLOW"
    held = await held_in_postgres(pg_dsn)
    await server.stop()  # every process stopped
    orgs = {t: ("acme" if i < 3 else "globex") for i, t in enumerate(TENANTS)}
    await apply_policies(pg_dsn, policies() | {"accounts.yaml": organisations_yaml(orgs)}, sha="6" * 40)
    variables = {"BUDGETGATE_LEDGER_SHARDS": str(SHARDS)}
    shown = await budgetgate_on(settings, "ledger", "roots", cwd=tmp_path, variables=variables)
    assert shown.returncode == 0, shown.stderr
    unpinned, pinned = Shards(settings.redis_prefix, SHARDS), Shards(settings.redis_prefix, SHARDS, orgs)
    moving = [t for t in TENANTS if unpinned.of_root(t) != pinned.of_root(t)]
    assert moving, "the test's organisations should move some tenant to another shard"
    assert "pinned now: none" in shown.stdout and f"{len(TENANTS)} tenant(s) move" in shown.stdout, shown.stdout
    assert f"{moving[0]}: its own root -> organisation {orgs[moving[0]]}, shard {unpinned.of_root(moving[0])} -> {pinned.of_root(moving[0])}" in shown.stdout

    conn = await asyncpg.connect(pg_dsn)  # another session: a process still running would place by the roots it started with
    try:
        refused = await budgetgate_on(settings, "ledger", "roots", "--apply", cwd=tmp_path, variables=variables)
        assert refused.returncode == 1 and "other session(s) are connected" in refused.stderr, refused
        assert await conn.fetchval("SELECT count(*) FROM ledger_roots") == 0
    finally:
        await conn.close()
    await wait_for(lambda: _alone(pg_dsn), timeout=10, what="the test's sessions closed")
    applied = await budgetgate_on(settings, "ledger", "roots", "--apply", cwd=tmp_path, variables=variables)
    assert applied.returncode == 0 and "pinned; rebuilt Redis" in applied.stdout, applied

    server = await admission_factory(ledger_shards=SHARDS, pg_pool_max=30)
    await server.wait_ready()
    assert server.rt.ledgers.shards.roots == orgs
    assert await held_in_redis(server) == held == await held_in_postgres(pg_dsn)
    await each_shard_holds_its_tenants_alone(server, held, pinned)
    # What each tenant held before the move counts on its new shard: a second 8 GPU-hour run fits
    # its 20, a third does not.
    for t in TENANTS:
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 1))) == "ALLOW"
        assert decision_of(await server.client.post("/v1/admissions", json=run(t, 2))) == "DENY"
    assert await held_in_redis(server) == await held_in_postgres(pg_dsn)

    reconciler = await reconciler_factory(ledger_shards=SHARDS)
    assert reconciler.ledgers.shards.roots == orgs
    start = datetime.now(UTC) - timedelta(minutes=40)
    for t in TENANTS:  # run 0 ran half an hour on its 8 GPUs and completed
        await feed.send(*ran_half_an_hour(f"{t}/run-0", start))
    await wait_caught_up(reconciler)
    figures = await ledger_figures(pg_dsn)
    assert set(figures.values()) == {(8 * GPU_HOUR, 4 * GPU_HOUR)}  # run 1 holds its 8; run 0 consumed 4
    for t in TENANTS:
        [key] = [k for k in figures if f"team={t}|" in k]
        assert await server.rt.ledgers.of_root(t).readings([key]) == {key: figures[key]}
        assert server.rt.ledgers.of_root(t).shard == pinned.of_root(t)
    assert all([(await sync.check_drift(repair=False)).clean for sync in reconciler.ledgers.syncs])


async def _alone(dsn: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return not await conn.fetch(sql("other_sessions"))
    finally:
        await conn.close()
