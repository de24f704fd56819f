"""The local stack of one checkout: bring it up, describe it, take it down.

Order on the way up: Postgres, Redis, Kafka (each given by a BUDGETGATE_* variable, else
embedded), then migrations and topics, then every service that exists. On the way down, the
reverse. Each process is written to the state file as soon as it starts, so whatever happens to
`dev up` midway, `dev down` can still stop what it left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from budgetgate.devstack import isolation
from budgetgate.devstack.embedded import EmbeddedServer, ServerStartError
from budgetgate.devstack.isolation import ExternalServerError, redact
from budgetgate.devstack.kafka import TansuBroker
from budgetgate.devstack.ports import free_port, port_open
from budgetgate.devstack.postgres import EmbeddedPostgres, pg_ctl_stop
from budgetgate.devstack.processes import ProcessRecord, is_running, read_cmdline, terminate, wait_gone
from budgetgate.devstack.redis import EmbeddedRedis
from budgetgate.devstack.redis_cluster import EmbeddedRedisCluster
from budgetgate.devstack.services import SERVICES, Service, ServiceNotReady, log_tail, start_service, wait_ready
from budgetgate.devstack.state import StackState, StateFileError, stack_lock, state_dir
from budgetgate.runtime.redis_client import is_cluster_url
from budgetgate.runtime.settings import find_dev_state, fingerprint

Echo = Callable[[str], None]

# The database an embedded Postgres serves budgetgate from (not `postgres`, kept for admin use).
EMBEDDED_DATABASE = "budgetgate"


class StackStepError(RuntimeError):
    """A step after the servers (migrations, topics) failed."""


STACK_ERRORS = (ServerStartError, ServiceNotReady, ExternalServerError, StateFileError, StackStepError)


@dataclass(frozen=True)
class UpResult:
    state: StackState
    already_up: bool


def up(root: Path, *, timeout: float = 60.0, services: bool = True, redis_cluster: bool = False, echo: Echo = print) -> UpResult:
    """Start the stack of `root` unless one is up already; on any failure, stop what was started.
    `redis_cluster`: an embedded Redis Cluster (three masters with a replica each) instead of one
    redis-server."""
    root = root.resolve()
    with stack_lock(root):
        existing = StackState.load(root)
        if existing is not None:
            if existing.complete and (not existing.processes or any(existing.alive().values())):
                return UpResult(existing, already_up=True)
            echo("the stack recorded here is no longer running, or was never finished; starting a new one")
            _stop_all(existing, echo)
            StackState.remove(root)
        state = StackState(root=root)
        try:
            _start(state, timeout=timeout, services=services, redis_cluster=redis_cluster, echo=echo)
        except BaseException:
            echo("start-up failed; stopping what was started")
            _stop_all(state, echo)
            StackState.remove(root)
            raise
        state.complete = True
        state.save()
        return UpResult(state, already_up=False)


def _start(state: StackState, *, timeout: float, services: bool, redis_cluster: bool, echo: Echo) -> None:
    tag = isolation.checkout_tag(state.root)
    state.settings = dict.fromkeys(
        ("postgres_dsn", "redis_url", "redis_prefix", "kafka_bootstrap", "topic_prefix", "admission_url", "metering_url", "reconciler_url")
    )
    state.save()
    _provide_postgres(state, tag=tag, timeout=timeout, echo=echo)
    _provide_redis(state, tag=tag, timeout=timeout, cluster=redis_cluster, echo=echo)
    _provide_kafka(state, tag=tag, timeout=timeout, echo=echo)
    state.save()
    _migrate(str(state.settings["postgres_dsn"]), echo)
    _issue_tokens(state, echo)
    _create_topics(str(state.settings["kafka_bootstrap"]), str(state.settings["topic_prefix"]), echo)
    if services:
        _start_services(state, timeout=timeout, echo=echo)


def _logs(state: StackState) -> Path:
    return state_dir(state.root) / "logs"


def _start_embedded(state: StackState, server: EmbeddedServer, *, timeout: float, echo: Echo) -> None:
    started = time.monotonic()
    # Recorded as soon as it is spawned, and again once it answers (with the command line it shows
    # then): should `dev up` die while the server starts, `dev down` or the next `dev up` stops it.
    server.start(timeout=timeout, on_spawn=state.put)
    state.put(server.record())
    echo(f"{server.name}: embedded, {server.url} (up in {time.monotonic() - started:.1f}s)")


def _provide_postgres(state: StackState, *, tag: str, timeout: float, echo: Echo) -> None:
    external = os.environ.get("BUDGETGATE_POSTGRES_DSN")
    if external:
        database = isolation.database_name(tag)
        asyncio.run(isolation.ensure_database(external, database))
        dsn = isolation.with_database(external, database)
        state.settings["postgres_dsn"] = dsn
        state.from_env["postgres_dsn"] = fingerprint(external)
        echo(f"postgres: database {database} on the server of BUDGETGATE_POSTGRES_DSN")
        return
    server = EmbeddedPostgres(data_dir=state_dir(state.root) / "postgres", log=_logs(state) / "postgres.log")
    _start_embedded(state, server, timeout=timeout, echo=echo)
    asyncio.run(isolation.ensure_database(server.dsn(), EMBEDDED_DATABASE))
    state.settings["postgres_dsn"] = server.dsn(EMBEDDED_DATABASE)


def _provide_redis(state: StackState, *, tag: str, timeout: float, cluster: bool, echo: Echo) -> None:
    external = os.environ.get("BUDGETGATE_REDIS_URL")
    prefix = os.environ.get("BUDGETGATE_REDIS_PREFIX")
    if external and cluster and not is_cluster_url(external):
        raise ExternalServerError(
            f"--redis-cluster with BUDGETGATE_REDIS_URL={redact(external)}, which names no cluster: "
            "unset it for an embedded cluster, or give a redis+cluster:// URL"
        )
    if external:
        isolation.check_redis(external)
        state.settings["redis_url"] = external
        state.settings["redis_prefix"] = prefix or isolation.redis_prefix(tag)
        echo(f"redis: {external} (BUDGETGATE_REDIS_URL), key prefix {state.settings['redis_prefix']}")
        return
    if cluster:
        started = time.monotonic()
        redis_cluster = EmbeddedRedisCluster(state_dir(state.root) / "redis-cluster").start(timeout=timeout, record=state.put)
        state.settings["redis_url"] = redis_cluster.url
        echo(f"redis: embedded cluster of {len(redis_cluster.nodes)} nodes, {redis_cluster.url} (up in {time.monotonic() - started:.1f}s)")
    else:
        server = EmbeddedRedis(log=_logs(state) / "redis.log", workdir=state_dir(state.root) / "redis")
        _start_embedded(state, server, timeout=timeout, echo=echo)
        state.settings["redis_url"] = server.url
    state.settings["redis_prefix"] = prefix or "bg"


LOCAL_SESSION_TIMEOUT_MS = 3_000


def _provide_kafka(state: StackState, *, tag: str, timeout: float, echo: Echo) -> None:
    external = os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP")
    prefix = os.environ.get("BUDGETGATE_TOPIC_PREFIX")
    if external:
        isolation.check_kafka(external)
        state.settings["kafka_bootstrap"] = external
        state.settings["topic_prefix"] = prefix if prefix is not None else isolation.topic_prefix(tag)
        echo(f"kafka: {external} (BUDGETGATE_KAFKA_BOOTSTRAP), topic prefix {state.settings['topic_prefix']!r}")
        return
    server = TansuBroker(log=_logs(state) / "kafka.log")
    _start_embedded(state, server, timeout=timeout, echo=echo)
    state.settings["kafka_bootstrap"] = server.url
    state.settings["topic_prefix"] = prefix or ""
    # Tansu completes a group join after half the session timeout: the local stack's services
    # join theirs in 1.5 s rather than 5 (BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS still wins).
    state.settings["kafka_session_timeout_ms"] = LOCAL_SESSION_TIMEOUT_MS


def _migrate(dsn: str, echo: Echo) -> None:
    try:
        from budgetgate.ledger.migrations import migrate_dsn
    except ModuleNotFoundError as exc:
        if exc.name != "budgetgate.ledger.migrations":
            raise
        echo("migrations: skipped, this checkout has no budgetgate.ledger.migrations yet")
        return
    try:
        applied = asyncio.run(migrate_dsn(dsn))
    except Exception as exc:
        raise StackStepError(f"migrations failed on {dsn}: {exc}") from exc
    echo(f"migrations: {len(applied)} applied" + (f" ({', '.join(applied)})" if applied else ", schema up to date"))


def _issue_tokens(state: StackState, echo: Echo) -> None:
    """One API token per role for this stack, replacing (revoking) those of an earlier `dev up`."""
    from budgetgate.devstack.access_tokens import issue_dev_tokens

    try:
        state.tokens = asyncio.run(issue_dev_tokens(str(state.settings["postgres_dsn"])))
    except Exception as exc:
        raise StackStepError(f"creating the stack's API tokens failed: {exc}") from exc
    state.save()
    echo(f"tokens: one per role ({', '.join(state.tokens)}), in {state_dir(state.root) / 'dev.json'} (`budgetgate dev status --json`)")


def _create_topics(bootstrap: str, prefix: str, echo: Echo) -> None:
    try:
        from budgetgate.messaging.topic_admin import ensure_topics
    except ModuleNotFoundError as exc:
        if exc.name != "budgetgate.contracts.topics":
            raise
        echo("topics: skipped, this checkout has no budgetgate.contracts.topics yet")
        return
    try:
        created = asyncio.run(ensure_topics(bootstrap, prefix=prefix))
    except Exception as exc:
        raise StackStepError(f"creating topics on {bootstrap} failed: {exc}") from exc
    echo(f"topics: {len(created)} ensured")


# What a service's log says when the port it was given was taken between the pick and its bind
# (another stack, a test's server): it is started again on another port.
_PORT_TAKEN = ("[Errno 98]", "address already in use")
_PORT_TRIES = 3


def _start_services(state: StackState, *, timeout: float, echo: Echo) -> None:
    # Start them all, then wait for each: their start-up times overlap instead of adding up.
    pending = [(service, _launch(service, state)) for service in SERVICES if _runnable(service, echo)]
    for service, (proc, url, log, offset) in pending:
        for tries_left in range(_PORT_TRIES - 1, -1, -1):
            try:
                awaiting = wait_ready(service, proc, url=url, log=log, log_offset=offset, timeout=timeout)
            except ServiceNotReady:
                if not tries_left or proc.poll() is None or not any(m in log_tail(log, since=offset) for m in _PORT_TAKEN):
                    raise
                echo(f"{service.name}: {url} was taken while it started; starting it on another port")
                proc, url, log, offset = _launch(service, state)
                continue
            break
        where = f" at {url}" if url else ""
        if awaiting:
            echo(f"{service.name}: serving{where}, not ready until an operator acts ({awaiting})")
        else:
            echo(f"{service.name}: ready{where}")
    _refresh_cmdlines(state)


def _runnable(service: Service, echo: Echo) -> bool:
    if not service.runnable():
        echo(f"{service.name}: not started, {service.module} has no __main__ yet")
        return False
    return True


def _launch(service: Service, state: StackState) -> tuple[subprocess.Popen[bytes], str, Path, int]:
    """Start `service` on a free port, publishing its URL and recording its process (replacing
    an earlier record of it): the process, its URL, its log and where this start's lines begin."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = _logs(state) / f"{service.name}.log"
    offset = log.stat().st_size if log.exists() else 0
    proc = start_service(service, settings=state.settings, port=port, log=log, cwd=state.root)
    if service.name == "admission":
        state.settings["admission_url"] = url
    elif service.name == "metering_ingest":
        state.settings["metering_url"] = url  # where budgetgate.client posts lifecycle events and samples
    elif service.name == "reconciler":
        state.settings["reconciler_url"] = url  # where `budgetgate settlements` finds the dead-lettered settlements
    state.put(
        ProcessRecord(
            name=service.name,
            pid=proc.pid,
            cmdline=[str(a) for a in proc.args],  # type: ignore[union-attr]
            log=str(log),
            extra={"url": url},
        )
    )
    return proc, url, log, offset


def _refresh_cmdlines(state: StackState) -> None:
    # A process may retitle itself once running; `down` must recognise it by what it shows now.
    state.processes = [replace(p, cmdline=read_cmdline(p.pid) or p.cmdline) for p in state.processes]
    state.save()


def down(root: Path, *, echo: Echo = print) -> bool:
    """Stop every process the stack of `root` started, and forget it; False if there was none."""
    root = root.resolve()
    with stack_lock(root):
        state = StackState.load(root)
        if state is None:
            return False
        _stop_all(state, echo)
        StackState.remove(root)
        return True


def _stop_all(state: StackState, echo: Echo) -> None:
    for record in reversed(state.processes):
        echo(f"{record.name}: {'stopped' if _stop(record) else 'was not running'}")


def _stop(record: ProcessRecord) -> bool:
    if not is_running(record):
        return False
    pgdata = Path(record.pgdata) if record.pgdata is not None else None
    if pgdata is not None and _postmaster_pid(pgdata) == record.pid and pg_ctl_stop(pgdata) and wait_gone(record, 10.0):
        return True
    # SIGINT is Postgres' fast shutdown, should pg_ctl have failed; everything else gets SIGTERM.
    return terminate(record, first=signal.SIGINT if record.pgdata else signal.SIGTERM)


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def find_root(start: Path | None = None) -> Path | None:
    """The folder of the local stack seen from `start`: BUDGETGATE_HOME, else the nearest folder
    at or above `start` holding `.budgetgate/dev.json`; None when there is none."""
    found = find_dev_state(start)
    return found.parent.parent if found is not None else None


# Where each backend's address is, and the port when the address has none.
_BACKENDS = (("postgres", "postgres_dsn", 5432), ("redis", "redis_url", 6379), ("kafka", "kafka_bootstrap", 9092))


def _address_open(address: str, default_port: int) -> bool:
    parts = urlsplit(address if "://" in address else f"tcp://{address.split(',')[0]}")
    return port_open(parts.hostname or "127.0.0.1", parts.port or default_port)


def status(root: Path) -> dict[str, Any] | None:
    """Settings, process liveness and every service's URL of the stack of `root`; None when
    there is none. Servers the stack did not start (given by variables) are checked by port."""
    state = StackState.load(root.resolve())
    if state is None:
        return None
    alive = state.alive()
    services = []
    for name, setting, port in _BACKENDS:
        url = state.settings.get(setting)
        # A server of one process, or a cluster of nodes (`redis-node-0`, ...: listed below too).
        own = [p.name for p in state.processes if p.name == name or p.name.startswith(f"{name}-node-")]
        if own:
            services.append({"name": name, "url": url, "alive": all(alive[n] for n in own), "started_here": True})
        elif url:
            services.append({"name": name, "url": url, "alive": _address_open(str(url), port), "started_here": False})
    for record in state.processes:
        if record.name not in {b[0] for b in _BACKENDS}:
            services.append({"name": record.name, "url": record.extra.get("url"), "alive": alive[record.name], "started_here": True})
    return {
        "root": str(state.root),
        "up": state.complete and all(s["alive"] for s in services),
        "complete": state.complete,
        **{k: redact(v) if isinstance(v, str) else v for k, v in state.settings.items()},
        "services": [{**s, "url": redact(s["url"]) if isinstance(s["url"], str) else s["url"]} for s in services],
        "tokens": state.tokens,
        "processes": [{"name": p.name, "pid": p.pid, "alive": alive[p.name], "log": p.log} for p in state.processes],
    }


def run_foreground(root: Path, *, echo: Echo = print) -> None:
    """Stay until Ctrl-C or SIGTERM, or until `dev down` runs elsewhere; then stop the stack."""
    reported: set[str] = set()
    try:
        while (state := StackState.load(root)) is not None:
            for name, alive in state.alive().items():
                if not alive and name not in reported:
                    reported.add(name)
                    echo(f"{name} is no longer running; see its log in {_logs(state)}")
            time.sleep(1.0)
    except KeyboardInterrupt:
        echo("stopping the stack")
    finally:
        down(root, echo=echo)
