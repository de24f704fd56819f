"""Fixtures every tier shares: real Postgres, Redis and Kafka, with one test isolated from another.

Servers are resolved once per session and only when a test asks for one (see
tests/support/backends.py for where they come from), so unit and property tests start nothing.
Each test gets its own database, Redis key prefix and topic prefix, so tests can run in parallel.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from budgetgate.runtime.redis_client import connect_sync
from budgetgate.runtime.settings import CommonSettings
from tests.support import backends
from tests.support.databases import DatabaseFactory, run_async
from tests.support.killable import KillablePostgres, KillableServer

TESTS = Path(__file__).parent

# Property tests judge results, never time: no per-example deadline and no complaint that data
# comes slowly, both of which a machine busy with the rest of the suite trips at random.
hypothesis_settings.register_profile("budgetgate", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("budgetgate")
# Tests under these folders get the folder's marker, so `-m "not faults"` and the like just work.
TIER_MARKERS = ("integration", "e2e", "faults", "property")
NO_SERVER_TIERS = ("unit", "property")
# The ledger suites: what reserves, releases, settles, rebuilds and checks the Redis ledger, and
# the faults that test it. They get the `ledger` marker, and CI runs them a second time on a
# Redis Cluster (`BUDGETGATE_TEST_REDIS=cluster pytest -m ledger`, `just test-cluster`).
LEDGER_SUITES = frozenset({
    "integration/test_ledger_lock.py", "integration/test_ledger_entries.py", "integration/test_ledger_cli.py",
    "integration/test_quota_stateful.py", "integration/test_budget_holds.py", "integration/test_provisional_holds.py",
    "integration/test_admission_batches.py", "integration/test_reconciler_incremental.py", "integration/test_redis_cluster.py",
    "faults/test_redis_rebuild.py", "faults/test_admission_faults.py", "faults/test_reconciler_crash_window.py",
    "faults/test_redis_cluster_faults.py", "integration/test_escrow_leases.py", "integration/test_shard_generations.py",
    "integration/test_sharded_ledger.py", "faults/test_reconciler_faults.py", "faults/test_scale_out.py",
    "integration/test_sharded_escrow.py", "integration/test_sharded_sensitive.py", "integration/test_ledger_keys_missing.py",
})  # fmt: skip
SERVER_FIXTURES = frozenset({
    "postgres_admin_dsn", "redis_server_url", "kafka_server_bootstrap", "pg_dsn", "redis_url",
    "redis_prefix", "kafka_bootstrap", "topic_prefix", "settings",
    "killable_postgres", "killable_redis", "killable_kafka",
})  # fmt: skip


@pytest.hookimpl(trylast=True)  # (after the terminal reporter is registered)
def pytest_configure(config: pytest.Config) -> None:
    # Consumer groups of the tests' services (in-process, or processes inheriting this
    # environment) on a 3 s session, not the default 10 s: Tansu completes a join after half the
    # session timeout, so every service start and every takeover waits 1.5 s instead of 5.
    os.environ.setdefault("BUDGETGATE_KAFKA_SESSION_TIMEOUT_MS", "3000")
    # Where the terminal is (xdist's controller, not its workers), and not under -v, which names
    # every test already.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(config, "workerinput") and config.get_verbosity() <= 0:
        config.pluginmanager.register(_FailuresAsTheyHappen(reporter), "budgetgate-failures-as-they-happen")
    # SIGTERM (`timeout` in .ci/run, a CI runner cancelling a job) kills a Python process
    # outright: no fixture teardown, so the servers the fixtures started in sessions of their own
    # (Postgres, Redis, Tansu) keep running, and an embedded Postgres's postmaster.pid with them.
    # As an interrupt it ends the run as Ctrl-C does, tearing every fixture down (xdist workers
    # load this file too, and `timeout` signals the whole process group).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    # Once: `timeout` sends SIGTERM to pytest and then to its whole group (pytest again), and a
    # second interrupt would cut the teardown short. A handler, not SIG_IGN: children started
    # during teardown must not inherit an ignored SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: None)
    raise KeyboardInterrupt(f"interrupted by signal {signum}")


def _tier(item: pytest.Item) -> str | None:
    try:
        return Path(item.path).relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None


def _suite(item: pytest.Item) -> str | None:
    """The item's file under tests/ (`integration/test_x.py`); None for one elsewhere (a test
    that runs pytest on files of its own)."""
    path = Path(item.path)
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m ledger` alone (CI's run on a Redis Cluster, `just test-cluster`) a test file
    outside the ledger suites is not even imported: each worker would collect the whole suite
    to deselect all but them (about 15 s of CPU a worker on a slow machine, against 1 s)."""
    if config.getoption("markexpr", "") != "ledger" or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if not collection_path.is_relative_to(TESTS) or collection_path.relative_to(TESTS).as_posix() in LEDGER_SUITES:
        return None
    return True


# The files that kept a worker longest in a whole run (2026-12-01), handed out first: pytest-xdist
# gives files to workers in collection order, so a slow file collected late can keep its worker
# busy after the others are done. (Which files ran last in CI's runs cut off at 97-99.5 % is not
# known: a run cut off prints no durations. One CI run with this order showed no gain. In three
# whole runs with it, on 2026-12-01 and 02, the six workers finished within 37-59 s of each other.)
SLOWEST_FIRST = (
    "integration/test_devstack.py", "integration/test_bench_smoke.py", "integration/test_kubernetes_webhook.py",
    "integration/test_admission.py", "integration/test_settlement_dead_letters.py", "integration/test_audit.py",
    "integration/test_consumer.py", "faults/test_redis_cluster_faults.py", "integration/test_metering_fold.py",
    "property/test_metering_props.py", "integration/test_reconciler.py", "integration/test_tenant_overrides.py",
    "e2e/test_lifecycle.py", "integration/test_metering_set_based.py", "integration/test_whatif.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if tier in TIER_MARKERS:
            item.add_marker(getattr(pytest.mark, tier))
        if _suite(item) in LEDGER_SUITES:
            item.add_marker(pytest.mark.ledger)
    # A stable sort: each file's tests stay together and in their order.
    rank = {suite: i for i, suite in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_suite(item), len(rank)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Keeps the fast tiers fast: a unit test that wants a server belongs in tests/integration.
    if _tier(item) in NO_SERVER_TIERS:
        wanted = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if wanted:
            pytest.fail(f"tests/{_tier(item)} runs without servers, but this test asks for {sorted(wanted)}")


class _FailuresAsTheyHappen:
    """A failure's name as it happens, not only in the summary at the end: a run cut off at its
    time limit (CI's, a runner's) prints no summary, and its dots say only that something failed."""

    def __init__(self, reporter: pytest.TerminalReporter) -> None:
        self.reporter = reporter

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            what = {"setup": "ERROR at setup of", "teardown": "ERROR at teardown of"}.get(report.when, "FAILED")
            self.reporter.write_line("")
            self.reporter.write_line(f"{what} {report.nodeid}", red=True, bold=True)


# -- servers, once per session ----------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_admin_dsn() -> Iterator[str]:
    """DSN of the `postgres` database on the session's Postgres server (create databases from it)."""
    with ExitStack() as stack:
        yield backends.postgres(stack).url


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    with ExitStack() as stack:
        yield backends.redis(stack).url


@pytest.fixture(scope="session")
def kafka_server_bootstrap() -> Iterator[str]:
    with ExitStack() as stack:
        yield backends.kafka(stack).url


@pytest.fixture(scope="session")
def _database_factory(postgres_admin_dsn: str) -> Iterator[DatabaseFactory]:
    factory = DatabaseFactory(postgres_admin_dsn)
    yield factory
    factory.close()


# -- per test ---------------------------------------------------------------------------------


@pytest.fixture
def pg_dsn(_database_factory: DatabaseFactory) -> Iterator[str]:
    """DSN of a database of this test's own, fully migrated, dropped afterwards."""
    name, dsn = _database_factory.create()
    yield dsn
    _database_factory.drop(name)


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The session's Redis; keep to `redis_prefix` in key names."""
    return redis_server_url


@pytest.fixture
def redis_prefix(redis_server_url: str) -> Iterator[str]:
    """A key prefix unique to this test; every key containing it is deleted afterwards."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield prefix
    client = connect_sync(redis_server_url)
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


@pytest.fixture
def kafka_bootstrap(kafka_server_bootstrap: str) -> str:
    """The session's Kafka; name topics and consumer groups with `topic_prefix`."""
    return kafka_server_bootstrap


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A topic name prefix unique to this test; on the session's broker, every topic under it is
    deleted afterwards (after the test's services stopped: they depend on this fixture)."""
    prefix = f"t{uuid.uuid4().hex[:10]}-"
    yield prefix
    if "kafka_server_bootstrap" in request.fixturenames:
        from tests.support.kafka import delete_prefixed_topics  # (aiokafka: not for tests without a broker)

        bootstrap = request.getfixturevalue("kafka_server_bootstrap")
        run_async(lambda: delete_prefixed_topics(bootstrap, prefix))


@pytest.fixture
def settings(pg_dsn: str, redis_url: str, redis_prefix: str, kafka_bootstrap: str, topic_prefix: str) -> CommonSettings:
    """CommonSettings wired to this test's database, Redis prefix and topic prefix."""
    return CommonSettings(
        postgres_dsn=pg_dsn,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        kafka_bootstrap=kafka_bootstrap,
        topic_prefix=topic_prefix,
        service_name="budgetgate-test",
        otlp_endpoint=None,
    )


# -- fault tests: private servers to kill -----------------------------------------------------


@pytest.fixture
def killable_postgres() -> Iterator[KillablePostgres]:
    """A private Postgres: `.dsn`, `.stop()` kills it, `.start()` restarts it with its data."""
    with ExitStack() as stack:
        yield KillablePostgres(backends.run_embedded(stack, backends.new_postgres(stack)))


@pytest.fixture
def killable_redis() -> Iterator[KillableServer]:
    """A private Redis: `.url`, `.stop()` kills it, `.start()` restarts it EMPTY."""
    with ExitStack() as stack:
        yield KillableServer(backends.run_embedded(stack, backends.new_redis(stack)))


@pytest.fixture
def killable_kafka() -> Iterator[KillableServer]:
    """A private Tansu broker: `.url` (bootstrap), `.stop()` kills it, `.start()` restarts it EMPTY."""
    with ExitStack() as stack:
        yield KillableServer(backends.run_embedded(stack, backends.new_kafka(stack)))
