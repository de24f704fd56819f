"""The shared fixtures and the local stack (`budgetgate dev up/status/down`), on real servers."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest
import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from budgetgate.core.principals import Role
from budgetgate.devstack import stack
from budgetgate.devstack.isolation import checkout_tag, database_name
from budgetgate.devstack.postgres import EmbeddedPostgres
from budgetgate.devstack.processes import ProcessRecord
from budgetgate.devstack.redis import EmbeddedRedis
from budgetgate.devstack.state import StackState
from budgetgate.devstack.ports import free_port, port_open, split_host_port
from budgetgate.ledger.migrations import migration_files
from budgetgate.runtime.settings import CommonSettings
from tests.support.databases import DatabaseFactory
from tests.support.devstack import NO_BACKEND_ENV, alive_pids, checkout, dev, new_checkout, not_zombie, status  # noqa: F401 - checkout, new_checkout: fixtures
from tests.support.kafka import delete_prefixed_topics
from tests.support.killable import KillablePostgres, KillableServer

# -- fixtures ---------------------------------------------------------------------------------


async def test_killable_redis_comes_back_empty_on_the_same_port(killable_redis: KillableServer) -> None:
    client = aioredis.Redis.from_url(killable_redis.url)
    try:
        await client.set("k", "v")
        port = killable_redis.port
        killable_redis.stop()
        assert not port_open("127.0.0.1", port)
        with pytest.raises(aioredis.ConnectionError):
            await client.get("k")
        killable_redis.start()
        assert killable_redis.port == port
        assert await client.get("k") is None
        assert await client.dbsize() == 0
    finally:
        await client.aclose()


async def test_killable_postgres_keeps_committed_data_across_a_kill(killable_postgres: KillablePostgres) -> None:
    conn = await asyncpg.connect(killable_postgres.dsn)
    await conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1), (2)")
    killable_postgres.stop()
    # Whatever asyncpg makes of a server gone: a reset, its FATAL notice, a closed connection, or
    # (that notice read while the next query was being sent) its own protocol state error.
    with pytest.raises((ConnectionError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)):
        await conn.fetchval("SELECT 1")
    conn.terminate()
    with pytest.raises(OSError):
        await asyncpg.connect(killable_postgres.dsn, timeout=2)
    killable_postgres.start()
    conn = await asyncpg.connect(killable_postgres.dsn)
    try:
        assert await conn.fetchval("SELECT sum(n) FROM kept") == 3
    finally:
        await conn.close()


async def test_killable_kafka_comes_back_without_topics(killable_kafka: KillableServer, topic_prefix: str) -> None:
    topic = f"{topic_prefix}kept"
    admin = AIOKafkaAdminClient(bootstrap_servers=killable_kafka.url)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        assert topic in await admin.list_topics()
    finally:
        await admin.close()
    killable_kafka.stop()
    assert not port_open(*split_host_port(killable_kafka.url, 9092))
    killable_kafka.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=killable_kafka.url)
    await admin.start()
    try:
        assert topic not in await admin.list_topics()
    finally:
        await admin.close()


LEFTOVER = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'postgres: leftover', 0, 0, 0); time.sleep(120)"


def _leftover(data_dir: Path, planted: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A process named like a backend, working in the data directory, outside the server's
    process group: what a backend the group's SIGKILL missed (or one slow to die) looks like.
    Added to `planted` at once, for the test to reap whatever happens."""
    proc = subprocess.Popen([sys.executable, "-c", LEFTOVER], cwd=data_dir, start_new_session=True)
    planted.append(proc)
    deadline = time.monotonic() + 10
    # (process_iter's info dict: a process that ends while listed is skipped, not raised on)
    while proc.pid not in {p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("postgres")} and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


async def test_a_killed_postgres_leaves_nothing_working_in_its_data_directory(killable_postgres: KillablePostgres) -> None:
    server = killable_postgres._server
    planted: list[subprocess.Popen[bytes]] = []
    try:
        missed = _leftover(server.data_dir, planted)
        assert missed.pid in {p.pid for p in server.leftovers()}
        killable_postgres.stop()
        missed.wait(timeout=10)  # (reaped by the kill's wait already: its code is lost)
        assert not psutil.pid_exists(missed.pid) and server.leftovers() == []
        # Left over from a postmaster killed some other way: the next start clears them first.
        orphan = _leftover(server.data_dir, planted)
        killable_postgres.start()
        orphan.wait(timeout=10)
        assert not psutil.pid_exists(orphan.pid)  # (the new server's own processes work there now)
    finally:
        # Never left running (nor unreaped, which warns in whatever test runs next) if a step fails.
        for proc in planted:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    conn = await asyncpg.connect(killable_postgres.dsn)
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


async def test_pg_dsn_is_migrated_and_its_own(pg_dsn: str, _database_factory: DatabaseFactory) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        applied = [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations ORDER BY name")]
        assert applied == [name for name, _ in migration_files()]
        await conn.execute("CREATE TABLE only_here (n int)")
    finally:
        await conn.close()
    name, other = _database_factory.create()
    try:
        assert other != pg_dsn
        conn = await asyncpg.connect(other)
        try:
            assert await conn.fetchval("SELECT to_regclass('only_here')") is None
            assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(applied)
        finally:
            await conn.close()
    finally:
        _database_factory.drop(name)


def test_settings_point_at_this_tests_own_resources(settings: CommonSettings, pg_dsn: str, redis_prefix: str, topic_prefix: str) -> None:
    assert (settings.postgres_dsn, settings.redis_prefix, settings.topic_prefix) == (pg_dsn, redis_prefix, topic_prefix)
    assert redis_prefix != "bg" and topic_prefix != ""


async def test_a_tests_topics_are_deleted_and_no_other_prefix_s(kafka_server_bootstrap: str, topic_prefix: str) -> None:
    # What the topic_prefix fixture does after a test: its topics go, another prefix's stay.
    ours, theirs = f"{topic_prefix}a", f"{topic_prefix.rstrip('-')}x-a"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_server_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(ours, 1, 1), NewTopic(f"{topic_prefix}b", 2, 1), NewTopic(theirs, 1, 1)])
        assert await delete_prefixed_topics(kafka_server_bootstrap, topic_prefix) == [ours, f"{topic_prefix}b"]
        left = {t for t in await admin.list_topics() if t.startswith(topic_prefix.rstrip("-"))}
        assert left == {theirs}
        await admin.delete_topics([theirs])
    finally:
        await admin.close()


# -- dev up / status / down -------------------------------------------------------------------


async def test_up_status_down_with_embedded_servers(checkout: Path) -> None:
    started = dev(checkout, "up", "--detach", "--no-services")
    assert started.returncode == 0, started.stderr
    info = status(checkout)
    assert info["up"] is True
    assert set(alive_pids(info)) == {"postgres", "redis", "kafka"}
    conn = await asyncpg.connect(info["postgres_dsn"])
    try:
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(migration_files())
    finally:
        await conn.close()
    client = aioredis.Redis.from_url(info["redis_url"])
    assert await client.ping()
    await client.aclose()
    assert port_open(*split_host_port(info["kafka_bootstrap"], 9092))
    # Settings reach any command run in the checkout through the state file.
    published = json.loads((checkout / ".budgetgate" / "dev.json").read_text())["settings"]
    assert published["redis_url"] == info["redis_url"]
    # The embedded broker's groups on a short session, so the services join in 1.5 s.
    assert published["kafka_session_timeout_ms"] == 3_000
    # One token per role, readable by the owner only, and live in the stack's database.
    assert set(info["tokens"]) == {role.value for role in Role}  # one token per role, accounting included
    assert (checkout / ".budgetgate" / "dev.json").stat().st_mode & 0o777 == 0o600
    conn = await asyncpg.connect(info["postgres_dsn"])
    try:
        live = await conn.fetch("SELECT roles FROM api_tokens WHERE revoked_at IS NULL")
        assert sorted(r["roles"][0] for r in live) == sorted(info["tokens"])
    finally:
        await conn.close()

    again = dev(checkout, "up", "--detach", "--no-services")
    assert again.returncode == 0 and "already up" in again.stdout
    assert alive_pids(status(checkout)) == alive_pids(info)

    stopped = dev(checkout, "down")
    assert stopped.returncode == 0, stopped.stderr
    assert not (checkout / ".budgetgate" / "dev.json").exists()
    assert not any(Path(f"/proc/{pid}").exists() and not_zombie(pid) for pid in alive_pids(info).values())
    assert dev(checkout, "down").returncode == 0
    assert dev(checkout, "status").returncode == 1


def test_two_checkouts_run_side_by_side(new_checkout) -> None:  # type: ignore[no-untyped-def]
    roots = [new_checkout(), new_checkout()]
    for root in roots:
        result = dev(root, "up", "--detach", "--no-services")
        assert result.returncode == 0, result.stderr
    a, b = (status(root) for root in roots)
    for key in ("postgres_dsn", "redis_url", "kafka_bootstrap"):
        assert a[key] != b[key]
    assert a["up"] and b["up"]


def test_up_on_shared_servers_isolates_the_checkout(checkout: Path, postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    env = {"BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_REDIS_URL": redis_server_url,
           "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}  # fmt: skip
    database = database_name(checkout_tag(checkout))
    try:
        result = dev(checkout, "up", "--detach", "--no-services", env=env)
        assert result.returncode == 0, result.stderr
        info = json.loads(dev(checkout, "status", "--json").stdout)
        assert info["processes"] == []  # nothing of its own to run
        assert info["postgres_dsn"].endswith(f"/{database}")
        assert info["redis_prefix"] == f"bg-{checkout_tag(checkout)}"
        assert info["topic_prefix"] == f"{checkout_tag(checkout)}-"
        assert (info["redis_url"], info["kafka_bootstrap"]) == (redis_server_url, kafka_server_bootstrap)
        assert dev(checkout, "down").returncode == 0
    finally:
        from tests.support.databases import _execute, run_async

        run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


def test_up_and_status_never_print_the_postgres_password(checkout: Path, postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    secret = "s3cret-pw"
    with_password = postgres_admin_dsn.replace("postgres@", f"postgres:{secret}@", 1)
    assert secret in with_password  # the test servers trust local connections, so any password works
    env = {"BUDGETGATE_POSTGRES_DSN": with_password, "BUDGETGATE_REDIS_URL": redis_server_url, "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}
    database = database_name(checkout_tag(checkout))
    try:
        up = dev(checkout, "up", "--detach", "--no-services", env=env)
        assert up.returncode == 0, up.stderr
        printed = [up.stdout, up.stderr]
        for args in (("status",), ("status", "--json")):
            result = dev(checkout, *args, env=env)
            printed += [result.stdout, result.stderr]
        assert not any(secret in text for text in printed)
        assert "***" in json.loads(dev(checkout, "status", "--json", env=env).stdout)["postgres_dsn"]
        assert (checkout / ".budgetgate" / "dev.json").read_text().count(secret) == 1  # the stack's own DSN, for its commands
        assert dev(checkout, "down").returncode == 0
    finally:
        from tests.support.databases import _execute, run_async

        run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


def test_up_that_fails_names_the_culprit_and_leaves_nothing_running(checkout: Path) -> None:
    result = dev(checkout, "up", "--detach", "--no-services", env={"BUDGETGATE_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert result.returncode == 1
    assert "Redis at redis://127.0.0.1:1/0 does not answer" in result.stderr
    assert "postgres: stopped" in result.stderr  # the embedded Postgres it had started
    assert not (checkout / ".budgetgate" / "dev.json").exists()


def test_down_signals_only_processes_that_still_run_what_up_started(checkout: Path) -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        state = {"settings": {}, "processes": [
            {"name": "admission", "pid": bystander.pid, "cmdline": ["python", "-m", "budgetgate.services.admission"],
             "log": "/dev/null"}]}  # fmt: skip
        (checkout / ".budgetgate").mkdir()
        (checkout / ".budgetgate" / "dev.json").write_text(json.dumps(state))
        result = dev(checkout, "down")
        assert result.returncode == 0
        assert "admission: was not running" in result.stderr
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_up_stops_what_an_abandoned_up_left_running(checkout: Path) -> None:
    leftover = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        state = {"settings": {}, "complete": False, "processes": [
            {"name": "redis", "pid": leftover.pid, "cmdline": ["sleep", "60"], "log": "/dev/null"}]}  # fmt: skip
        (checkout / ".budgetgate").mkdir()
        (checkout / ".budgetgate" / "dev.json").write_text(json.dumps(state))
        assert dev(checkout, "status").returncode == 2
        result = dev(checkout, "up", "--detach", "--no-services")
        assert result.returncode == 0, result.stderr
        assert "redis: stopped" in result.stderr
        assert leftover.wait(timeout=5) == -15
        assert status(checkout)["up"] is True
    finally:
        leftover.kill()
        leftover.wait()


def test_up_replaces_a_stack_whose_processes_all_died(checkout: Path) -> None:
    assert dev(checkout, "up", "--detach", "--no-services").returncode == 0
    first = status(checkout)
    for pid in alive_pids(first).values():
        os.killpg(pid, 9)
    assert dev(checkout, "status").returncode == 1
    again = dev(checkout, "up", "--detach", "--no-services")
    assert again.returncode == 0, again.stderr
    assert "no longer running" in again.stderr
    assert status(checkout)["up"] is True


def test_every_command_finds_the_stack_from_a_subfolder_or_budgetgate_home(new_checkout) -> None:  # type: ignore[no-untyped-def]
    checkout, elsewhere = new_checkout(), new_checkout()
    assert dev(checkout, "up", "--detach", "--no-services").returncode == 0
    sub = checkout / "policies" / "teams"
    sub.mkdir(parents=True)
    info = status(sub)
    assert info["root"] == str(checkout)
    assert {s["name"]: s["url"] for s in info["services"]} == {
        "postgres": info["postgres_dsn"], "redis": info["redis_url"], "kafka": info["kafka_bootstrap"]}  # fmt: skip
    listed = dev(sub, "status")
    for service in info["services"]:
        assert f"{service['url']}" in listed.stdout
    assert json.loads(dev(elsewhere, "status", "--json", env={"BUDGETGATE_HOME": str(checkout)}).stdout)["root"] == str(checkout)
    assert dev(elsewhere, "status").returncode == 1  # no stack there, and none above it

    # Any other command from the subfolder reaches that stack, and says so on stderr.
    base = {k: v for k, v in os.environ.items() if k not in NO_BACKEND_ENV}
    result = subprocess.run([sys.executable, "-m", "budgetgate.cli.main", "usage", "--scope", "x"], cwd=sub, env=base,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert f"budgetgate: postgres at {info['postgres_dsn']} (stack in {checkout})" in result.stderr
    assert result.returncode == 1 and "Traceback" not in result.stderr


def test_up_exits_non_zero_when_a_part_is_not_running(checkout: Path) -> None:
    assert dev(checkout, "up", "--detach", "--no-services").returncode == 0
    redis_pid = alive_pids(status(checkout))["redis"]
    os.killpg(redis_pid, 9)
    again = dev(checkout, "up", "--detach", "--no-services")
    assert again.returncode == 2
    assert "not running: redis" in again.stderr
    assert dev(checkout, "status").returncode == 2
    assert next(s for s in status(checkout)["services"] if s["name"] == "redis")["alive"] is False


ADMISSION_MAIN = "budgetgate.services.admission.__main__"


@pytest.mark.skipif(
    importlib.util.find_spec(ADMISSION_MAIN) is None,
    reason=f"{ADMISSION_MAIN} does not exist yet, so `dev up` has no admission service to start",
)
def test_up_starts_admission_and_down_stops_it(checkout: Path) -> None:
    result = dev(checkout, "up", "--detach")
    assert result.returncode == 0, result.stderr
    info = status(checkout)
    assert "admission" in alive_pids(info)
    assert httpx.get(f"{info['admission_url']}/healthz", timeout=5).status_code == 200
    readiness = httpx.get(f"{info['admission_url']}/readyz", timeout=5)
    # A fresh stack has no policy bundle: admission fails closed until one is applied.
    checks = readiness.json()["checks"]
    assert checks["postgres"] == "ok" and checks["redis_ledger"] == "ok", checks
    # Authentication is on: the stack's reader token reads, nobody else does.
    assert httpx.get(f"{info['admission_url']}/v1/budgets", timeout=5).status_code == 401
    with_token = httpx.get(f"{info['admission_url']}/v1/budgets", headers={"Authorization": f"Bearer {info['tokens']['reader']}"}, timeout=5)
    assert with_token.status_code == 503 and "no policy bundle" in with_token.json()["detail"]
    # The reconciler is served as the others are, ready once it consumes; `budgetgate settlements`
    # finds it, and the operator token, in the stack's state.
    reconciler = httpx.get(f"{info['reconciler_url']}/readyz", timeout=5)
    assert reconciler.status_code == 200 and reconciler.json()["checks"]["kafka_consumer"] == "ok", reconciler.text
    base = {k: v for k, v in os.environ.items() if k not in NO_BACKEND_ENV and k != "BUDGETGATE_TOKEN"}
    listed = subprocess.run([sys.executable, "-m", "budgetgate.cli.main", "settlements", "dead-letters", "--json"], cwd=checkout, env=base,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    assert f"reconciler at {info['reconciler_url']}" in listed.stderr
    assert dev(checkout, "down").returncode == 0
    for url in (info["admission_url"], info["reconciler_url"]):
        assert not port_open(*split_host_port(url.removeprefix("http://"), 80))


def test_an_interrupted_server_start_leaves_no_server_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C while the server starts: it was spawned, it has not answered yet.
    spawned: list[ProcessRecord] = []

    def interrupted(self: EmbeddedRedis) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(EmbeddedRedis, "probe", interrupted)
    server = EmbeddedRedis(log=tmp_path / "redis.log", workdir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        server.start(timeout=30, on_spawn=spawned.append)
    (record,) = spawned
    assert record.name == "redis" and record.pid == server.pid
    assert not not_zombie(record.pid), "the half-started server is still running"


def test_up_interrupted_while_postgres_starts_records_it_at_once_and_leaves_nothing_behind(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The postmaster of an untracked Postgres kept its postmaster.pid, and the next `dev up`
    # could not start a Postgres on the data directory.
    for name in NO_BACKEND_ENV:
        monkeypatch.delenv(name, raising=False)
    seen: list[list[str]] = []

    def interrupted(self: EmbeddedPostgres) -> bool:
        state = StackState.load(checkout)
        seen.append([f"{p.name} {p.pid}" for p in state.processes] if state else [])
        lock = self.data_dir / "postmaster.pid"
        # As far into its start-up as it gets: the lock file written, with its pid (the
        # postmaster creates the file first and writes it after: read empty once in a full run).
        if lock.exists() and lock.read_text().split("\n", 1)[0].strip():
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(EmbeddedPostgres, "probe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stack.up(checkout, timeout=60, services=False, echo=lambda _line: None)
    assert seen and seen[-1][:1] == [f"postgres {_postmaster_pid(checkout)}"], f"not in the state file while it started: {seen}"
    assert not not_zombie(_postmaster_pid(checkout)), "the interrupted Postgres is still running"
    monkeypatch.undo()
    result = dev(checkout, "up", "--detach", "--no-services")
    assert result.returncode == 0, result.stderr
    assert status(checkout)["up"] is True


def _postmaster_pid(root: Path) -> int:
    # The lock of the killed postmaster stays behind; the next start removes it as stale.
    return int((root / ".budgetgate" / "postgres" / "postmaster.pid").read_text().split("\n", 1)[0])


# The services outlive the Popen objects of this process (`dev down` stops them by pid, as it would
# those of a `dev up` that has exited).
@pytest.mark.filterwarnings("ignore:subprocess .* is still running:ResourceWarning")
def test_a_service_whose_port_is_taken_while_it_starts_is_started_on_another(
    checkout: Path, postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stack picks a free port, then the service binds it: something else can bind it first.
    env = {"BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_REDIS_URL": redis_server_url, "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}
    database = database_name(checkout_tag(checkout))
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(stack, "free_port", lambda: next(picks, None) or free_port())
    echoed: list[str] = []
    try:
        assert dev(checkout, "up", "--detach", "--no-services", env=env).returncode == 0
        state = StackState.load(checkout)
        assert state is not None
        with monkeypatch.context() as patched:
            for name, value in env.items():
                patched.setenv(name, value)
            stack._start_services(state, timeout=120, echo=echoed.append)
        first = stack.SERVICES[0].name
        assert f"{first}: http://127.0.0.1:{taken} was taken while it started; starting it on another port" in echoed
        saved = StackState.load(checkout)
        assert saved is not None
        records = [p for p in saved.processes if p.name == first]
        assert len(records) == 1 and records[0].extra["url"] != f"http://127.0.0.1:{taken}"  # the stack records the new start only
        assert httpx.get(f"{records[0].extra['url']}/healthz", timeout=5).status_code == 200
    finally:
        squatter.close()
        dev(checkout, "down")
        from tests.support.databases import _execute, run_async

        run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
