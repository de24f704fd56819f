"""One campaign: start the cluster, run the plan's operations and faults concurrently, sample
the ledger, let the stack settle, observe the stores, and judge the history.

Timing is not replayed: operations start at their planned offsets on this machine's clock, and
how their answers interleave with the faults differs from run to run. What the seed fixes is
the plan (its fingerprint is in the history's setup line and in the summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import redis.asyncio as aioredis

from budgetgate.chaos import checkers, recorder
from budgetgate.chaos.cluster import (
    COMPANY_POLICY,
    POOL_LEASE_SECONDS,
    POOL_NAMESPACE,
    POOL_QUOTA,
    RECONCILER_ENV,
    Cluster,
    company_limit,
    shard_ledgers,
)
from budgetgate.chaos.nemesis import Nemesis
from budgetgate.chaos.schedule import Operation, Plan, plan
from budgetgate.ledger.redis_ledger import RedisLedger

CLIENT_TIMEOUT_SECONDS = 30.0
LEDGER_SAMPLE_SECONDS = 2.0
SNAPSHOT_SECONDS = 5.0
MAX_IN_FLIGHT = 64
# Operations resent until acknowledged (idempotent by their event or sample id), for so long.
RESENT_KINDS = ("lifecycle", "sample")
RESEND_SECONDS = 25.0

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    seed: int
    duration: float
    rate: float = 4.0
    faults: bool = True
    fault_kinds: tuple[str, ...] | None = None
    settle_seconds: float = 45.0
    folder: Path = Path(".budgetgate/chaos")
    keep_database: bool = False
    plant: str | None = None  # a bug planted on purpose (cluster.PLANTS)
    # "own": a Postgres server of its own, killed and paused by the Postgres faults; "shared": a
    # database on `server_dsn` (else BUDGETGATE_POSTGRES_DSN's server), the Postgres faults skipped.
    postgres: str = "own"
    server_dsn: str | None = None
    # Shards of the Redis ledger; with several, a budget every namespace shares is charged
    # through each tenant's escrow lease (cluster.COMPANY_POLICY).
    ledger_shards: int = 1


@dataclass
class Outcome:
    history: Path
    verdict: checkers.Verdict
    plan: Plan
    operations: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    skipped_faults: dict[str, str] = field(default_factory=dict)


class Campaign:
    def __init__(self, options: Options, *, echo: Echo = print) -> None:
        self.options = options
        self.echo = echo
        self.plan = plan(options.seed, options.duration, rate=options.rate, faults=options.faults, fault_kinds=options.fault_kinds)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.folder = options.folder / f"seed-{options.seed}-{stamp}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.recorder = recorder.Recorder(self.folder / "history.jsonl")
        self.cluster = Cluster(
            seed=options.seed,
            budgets=self.plan.budgets,
            folder=self.folder,
            echo=echo,
            plant=options.plant,
            server_dsn=options.server_dsn,
            postgres=options.postgres,
            ledger_shards=options.ledger_shards,
        )
        self.t0 = time.monotonic()
        self.admitted: set[str] = set()
        self.started: dict[str, datetime] = {}
        self.sample_bodies: dict[tuple[str, str], dict[str, Any]] = {}
        self.counts: dict[str, int] = {}
        self.gate = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def clock(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> Outcome:
        o = self.options
        self.echo(
            f"chaos: seed {o.seed}, {o.duration:g}s, plan {self.plan.fingerprint()}: {len(self.plan.operations)} operations, {len(self.plan.faults)} faults"
        )
        self.echo(f"chaos: history in {self.recorder.path}")
        nemesis: Nemesis | None = None
        # SIGTERM (a CI time limit) cancels the campaign, so that it still stops what it started
        # and drops its database; the history keeps what was written.
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await self.cluster.start()
            self.recorder.write(self._setup_line())
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_SECONDS) as client:
                self.client = client
                self.t0 = time.monotonic()
                nemesis = Nemesis(self.cluster, self.recorder, self.clock, self.echo)
                background = [self._spawn(self._sample_ledger()), self._spawn(self._snapshots())]
                faults = self._spawn(nemesis.run(self.plan.faults, self.t0))
                await self._drive(self.plan.operations)
                await faults
                self.echo(f"[{self.clock():7.1f}s] workload and faults done; settling")
                await self._settle()
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                self.recorder.write(await self._observe())
            self.recorder.write({"type": "end", "at": round(self.clock(), 3)})
        finally:
            # Cut short (SIGTERM, an error): what is still in flight stops before the history closes.
            pending = [t for t in self.tasks if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.recorder.close()
            await self.cluster.stop(keep_database=o.keep_database)
            loop.remove_signal_handler(signal.SIGTERM)
        verdict = checkers.check(recorder.read(self.recorder.path))
        (self.folder / "verdict.json").write_text(json.dumps(verdict.as_dict(), indent=2))
        return Outcome(
            self.recorder.path, verdict, self.plan, dict(self.counts), dict(nemesis.done) if nemesis else {}, dict(nemesis.skipped) if nemesis else {}
        )

    def _setup_line(self) -> dict[str, Any]:
        settings = {
            "client_timeout_seconds": CLIENT_TIMEOUT_SECONDS,
            "start_deadline_seconds": float(RECONCILER_ENV["BUDGETGATE_START_DEADLINE_SECONDS"]),
            "provisional_grace_seconds": float(RECONCILER_ENV["BUDGETGATE_PROVISIONAL_GRACE_SECONDS"]),
            "pool_quota": POOL_QUOTA,
            "pool_lease_seconds": POOL_LEASE_SECONDS,
            "rate": self.options.rate,
            "planted_bug": self.options.plant,
            "postgres": self.options.postgres,
        }
        return {
            "type": "setup",
            "seed": self.plan.seed,
            "duration": self.plan.duration,
            "fingerprint": self.plan.fingerprint(),
            "budgets": [asdict(b) for b in self.plan.budgets],
            "faults_planned": [asdict(f) for f in self.plan.faults],
            "operations_planned": len(self.plan.operations),
            "settings": settings,
            "database": self.cluster.database,
            "ledger_shards": self.options.ledger_shards,
            # A budget every namespace shares (several shards only): its policy and limit, in GPU-hours.
            "company": {"policy_id": COMPANY_POLICY, "gpu_hours": company_limit(self.plan.budgets)} if self.options.ledger_shards > 1 else None,
        }

    # --- the workload -------------------------------------------------------------------

    async def _drive(self, operations: tuple[Operation, ...]) -> None:
        tasks = []
        for op in operations:
            delay = self.t0 + op.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.gate.acquire()
            tasks.append(self._spawn(self._one(op)))
        await asyncio.gather(*tasks)

    async def _one(self, op: Operation) -> None:
        try:
            await self.perform(op)
        finally:
            self.gate.release()

    async def perform(self, op: Operation) -> None:
        kind, p = op.kind, op.params
        line: dict[str, Any] = {"type": "op", "index": op.index, "kind": kind, "instance": p.get("instance", 0), "planned": op.at}
        request = self._request(op)
        if request is None:
            line.update(invoke=round(self.clock(), 3), complete=round(self.clock(), 3), outcome="skipped", request=dict(p))
            self.recorder.write(line)
            self._count("skipped")
            return
        method, url, token, body, recorded = request
        attempt = 1
        began = time.monotonic()
        while True:
            line["request"] = recorded
            line["url"] = url
            line["invoke"] = round(self.clock(), 3)
            await self._send(op, line, method, url, token, body)
            self.recorder.write(line)
            self._count(f"{kind}:{line['outcome']}")
            # Lifecycle events and samples are resent until acknowledged, as their API asks
            # ("503: nothing was recorded; resend"; a resend deduplicates on the event or sample
            # id), to the other instance as a load balancer would; a platform that gave up
            # would leave a started run unknown to budgetgate, which is not the point here.
            if kind not in RESENT_KINDS or line["outcome"] != "info" or time.monotonic() - began > RESEND_SECONDS:
                return
            await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 3.0))
            attempt += 1
            url = _other_instance(url, self.cluster)
            line = {**{k: line[k] for k in ("type", "index", "kind", "planned")}, "instance": line["instance"], "attempt": attempt}

    async def _send(self, op: Operation, line: dict[str, Any], method: str, url: str, token: str, body: Any) -> None:
        try:
            response = await self.client.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"})
        except httpx.TimeoutException as exc:
            line.update(outcome="info", error=f"timeout: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            line.update(outcome="info", error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            status = response.status_code
            try:
                answer: Any = response.json()
            except ValueError:
                answer = response.text[:500]
            ok = status < 300 or (op.kind == "conflict" and status == 409)
            line.update(status=status, answer=answer, outcome="ok" if ok else "fail" if status < 500 else "info")
            self._learn(op, status, answer)
        line["complete"] = round(self.clock(), 3)

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _admission(self, p: dict[str, Any]) -> str:
        return self.cluster.services[f"admission-{p.get('instance', 0) + 1}"].url

    def _metering(self, p: dict[str, Any]) -> str:
        return self.cluster.services[f"metering-{p.get('instance', 0) + 1}"].url

    def _request(self, op: Operation) -> tuple[str, str, str, Any, dict[str, Any]] | None:
        """(method, url, token, body, what the history records) or None when skipped."""
        kind, p = op.kind, op.params
        tokens = self.cluster.tokens
        if kind in ("submit", "retry", "conflict"):
            return "POST", f"{self._admission(p)}/v1/admissions", tokens["submitter"], p["body"], p["body"]
        if kind == "lifecycle":
            run_id = p["run_id"]
            if p["type"] == "STARTED":
                if run_id not in self.admitted:
                    return None
                self.started[run_id] = datetime.now(UTC)
            elif run_id not in self.started:
                return None
            event = {"runId": run_id, "type": p["type"], "eventTime": _rfc3339(datetime.now(UTC)), "gpus": p["gpus"], "nodes": 1}
            return (
                "POST",
                f"{self._metering(p)}/v1/lifecycle/events",
                tokens["exporter"],
                {"events": [event]},
                {"run_id": run_id, "type": p["type"], "event": event},
            )
        if kind == "sample":
            key = (p["run_id"], p["sample_id"])
            if p.get("resend"):
                sample = self.sample_bodies.get(key)
                if sample is None:
                    return None
            else:
                begun = self.started.get(p["run_id"])
                if begun is None:
                    return None
                now = datetime.now(UTC)
                observed = now - timedelta(seconds=p.get("late_by", 0.0))
                if observed <= begun:
                    observed = begun + timedelta(milliseconds=100)
                seconds = min((observed - begun).total_seconds(), p["cap_seconds"])
                sample = {
                    "sampleId": p["sample_id"],
                    "runId": p["run_id"],
                    "observedAt": _rfc3339(observed),
                    "gpuSeconds": round(p["gpus"] * seconds * 0.8, 3),
                    "nodeSeconds": round(seconds * 0.8, 3),
                    "exporter": "chaos",
                }
                self.sample_bodies[key] = sample
            recorded = {"run_id": p["run_id"], "sample_id": p["sample_id"], "sample": sample, "resend": bool(p.get("resend"))}
            return "POST", f"{self._metering(p)}/v1/metering/samples", tokens["exporter"], {"samples": [sample]}, recorded
        if kind == "policy-apply":
            documents = [{"file": "chaos/policies.yaml", "line": i, "data": d} for i, d in enumerate(self.cluster.documents)]
            body = {"git_sha": f"chaos{self.plan.seed:x}r{p['revision']:06d}", "source": "budgetgate chaos", "documents": documents}
            return "POST", f"{self._admission(p)}/v1/policies", tokens["operator"], body, {"git_sha": body["git_sha"]}
        if kind == "tenant-override":
            body = {"max_gpus": p["max_gpus"], "reason": "chaos campaign"}
            return "PUT", f"{self._admission(p)}/v1/tenants/{p['tenant']}?create=true", tokens["operator"], body, {"tenant": p["tenant"], **body}
        if kind == "pool-allocate":
            body = {"token": p["token"], "project": p["project"], "lease_seconds": POOL_LEASE_SECONDS}
            return "POST", f"{self._admission(p)}/v1/pools/{POOL_NAMESPACE}/allocations", tokens["submitter"], body, body
        if kind == "pool-release":
            return "DELETE", f"{self._admission(p)}/v1/pools/{POOL_NAMESPACE}/allocations/{p['token']}", tokens["submitter"], None, {"token": p["token"]}
        raise ValueError(f"unknown operation kind {kind!r}")

    def _learn(self, op: Operation, status: int, answer: Any) -> None:
        if op.kind in ("submit", "retry") and status == 200 and isinstance(answer, dict) and answer.get("decision") == "ALLOW":
            self.admitted.add(op.params["run_id"])

    # --- sampling and settling ------------------------------------------------------------

    async def _sample_ledger(self) -> None:
        while True:
            await asyncio.sleep(LEDGER_SAMPLE_SECONDS)
            with contextlib.suppress(Exception):
                await self._ledger_once()

    async def _ledger_once(self) -> None:
        conn = await asyncpg.connect(self.cluster.dsn, timeout=5)
        try:
            rows = await conn.fetch(LEDGER_FIGURES, timeout=5)
        finally:
            await conn.close()
        at = round(self.clock(), 3)
        keys = {
            r["ledger_key"]: {"policy_id": r["policy_id"], "unit": r["unit"], "limit": r["limit_amount"], "held": r["held"], "consumed": r["consumed"]}
            for r in rows
        }
        self.recorder.write({"type": "ledger", "source": "postgres", "at": at, "keys": keys})
        client = aioredis.Redis(port=self.cluster.redis.primary.port, socket_timeout=3)
        try:
            in_redis: dict[str, dict[str, Any]] = {}
            for ledger in shard_ledgers(client, self.cluster.ledger_shards):  # each key on its shard
                in_redis.update(await _redis_figures(ledger, {key: figures for key, figures in keys.items() if ledger.owns_key(key)}))
        finally:
            await client.aclose()
        over = {key: figure for key, figure in in_redis.items() if "runs" in figure}
        if over:
            await _ended_in_postgres(self.cluster.dsn, over)
        self.recorder.write({"type": "ledger", "source": "redis", "at": round(self.clock(), 3), "keys": in_redis})

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_SECONDS)
            with contextlib.suppress(Exception):
                await self.cluster.redis.snapshot(round(self.clock(), 3))

    async def _settle(self) -> None:
        c = self.cluster
        for proxy in c.proxies:
            proxy.heal()
        if c.broker_paused:
            c.pause_broker(False)
        if c.postgres_paused:
            c.pause_postgres(False)
        if c.postgres is not None and not c.postgres.is_alive():
            await c.start_postgres()
        for name, service in c.services.items():
            if service.proc is None or service.proc.proc.poll() is not None or service.skew:
                await c.restart_service(name)
        # A submission to each admission instance after the faults: Redis is loaded again by then.
        for i in range(2):
            body = dict(self.plan.operations[0].params["body"]) if self.plan.operations else {}
            if body:
                body = {**body, "run_id": f"chaos/{self.plan.seed}/settle-{i}", "resources": {**body["resources"], "gpus": 1}, "projected_runtime_hours": 0.001}
                await self.perform(
                    Operation(
                        index=len(self.plan.operations) + i, at=self.clock(), kind="submit", params={"run_id": body["run_id"], "body": body, "instance": i}
                    )
                )
        deadline = time.monotonic() + self.options.settle_seconds
        while time.monotonic() < deadline:
            if await self._quiet():
                break
            await asyncio.sleep(1.0)
        # The start deadline and the provisional grace have their time to act.
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    async def _quiet(self) -> bool:
        conn = await asyncpg.connect(self.cluster.dsn, timeout=5)
        try:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS outbox,"
                " (SELECT count(*) FROM evidence_events WHERE state IN ('pending', 'waiting')) AS evidence"
            )
        finally:
            await conn.close()
        return row["outbox"] == 0 and row["evidence"] == 0

    async def _observe(self) -> dict[str, Any]:
        from budgetgate.chaos.observation import observe

        return await observe(self.cluster, at=round(self.clock(), 3), echo=self.echo)


LEDGER_FIGURES = """
SELECT e.ledger_key, e.policy_id, e.unit, e.limit_amount, e.consumed,
       COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS held
FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
GROUP BY e.ledger_key ORDER BY e.ledger_key
"""


async def _redis_figures(ledger: RedisLedger, keys: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Redis's (reserved, consumed) of every ledger key, read in one MULTI with the set of
    settlements parked between their halves. A parked settlement has applied only its increases
    (settle_begin.lua: the reservation it gives back comes off at settle_end), so on the keys it
    touches Redis is then deliberately tighter than either Postgres state: such keys are marked
    `parked`, and the conservation checker leaves them out of that sample."""
    names = list(keys)
    pipe = ledger.client.pipeline(transaction=True)
    pipe.smembers(ledger.parked)
    for key in names:
        pipe.hmget(ledger.ledger(key), "reserved", "consumed")
    parked_then, *figures = await pipe.execute()
    parked_keys: set[str] | None = set()
    if parked_then:
        runs, parked_keys = await ledger.parked_scope()
        if len(runs) < len(parked_then):
            parked_keys = None  # one resolved meanwhile, its keys unknown: every key counts as parked
    out = {}
    for key, (reserved, consumed) in zip(names, figures, strict=True):
        if reserved is None:
            continue
        figure = {"policy_id": keys[key]["policy_id"], "limit": keys[key]["limit"], "held": int(reserved), "consumed": int(consumed or 0)}
        if parked_keys is None or key in parked_keys:
            figure["parked"] = True
        out[key] = figure
    over = [key for key, figure in out.items() if not figure.get("parked") and figure["held"] + figure["consumed"] > figure["limit"]]
    if over:
        # Rare: which runs hold what on such a key, for the checker to tell a hold Postgres
        # ended (a release Redis lost, as after a restore from an old snapshot) from one it has
        # not committed (ahead of the decision's commit).
        holds = await ledger.run_holds()
        pipe = ledger.client.pipeline(transaction=False)
        for run_id in holds:
            pipe.hget(ledger.run(run_id), "_decision")
        decided = {run_id: _text_or_none(found) for run_id, found in zip(holds, await pipe.execute(), strict=True)}
        for key in over:
            out[key]["runs"] = {run_id: {"amount": held[key], "decision_id": decided[run_id]} for run_id, held in holds.items() if key in held}
    return out


def _text_or_none(found: bytes | str | None) -> str | None:
    return found.decode() if isinstance(found, bytes) else found


async def _ended_in_postgres(dsn: str, over: dict[str, dict[str, Any]]) -> None:
    """For each Redis figure over its limit, the runs whose reservation on that key, of the very
    decision Redis holds it for, Postgres holds no more (ended, read after Redis):
    `ended_in_postgres`. A run Postgres has no such reservation of is not among them (a decision
    not committed yet, or another attempt's)."""
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        for key, figure in over.items():
            runs = [(run_id, hold["decision_id"]) for run_id, hold in figure["runs"].items() if hold["decision_id"]]
            rows = await conn.fetch(ENDED_RESERVATIONS, key, [r for r, _ in runs], [d for _, d in runs], timeout=5)
            figure["ended_in_postgres"] = sorted(r["run_id"] for r in rows)
    finally:
        await conn.close()


ENDED_RESERVATIONS = """
SELECT r.run_id FROM reservations r JOIN unnest($2::text[], $3::text[]) AS h(run_id, decision_id)
  ON r.run_id = h.run_id AND r.decision_id::text = h.decision_id
WHERE r.ledger_key = $1 AND r.state <> 'held'
"""


def _other_instance(url: str, cluster: Cluster) -> str:
    """The same path on the other metering-ingest instance."""
    one, two = cluster.services["metering-1"].url, cluster.services["metering-2"].url
    if url.startswith(one):
        return two + url[len(one) :]
    if url.startswith(two):
        return one + url[len(two) :]
    return url


def _rfc3339(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def run(options: Options, *, echo: Echo = print) -> Outcome:
    return await Campaign(options, echo=echo).run()
