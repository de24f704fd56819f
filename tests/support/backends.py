"""Where the test session's Postgres, Redis and Kafka come from, decided once per server kind.

In order: the server named by BUDGETGATE_POSTGRES_DSN / BUDGETGATE_REDIS_URL /
BUDGETGATE_KAFKA_BOOTSTRAP; else a container, when a Docker engine answers; else an embedded
server started by the same code as `budgetgate dev up`. BUDGETGATE_TEST_REDIS=cluster runs the
session on an embedded Redis Cluster (three masters with a replica each) instead, whatever
BUDGETGATE_REDIS_URL says: the ledger suites run on both. Whatever is started here is registered
on the caller's ExitStack and stopped (and its files removed) when that closes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar


from budgetgate.devstack.embedded import EmbeddedServer
from budgetgate.devstack.kafka import TansuBroker
from budgetgate.devstack.postgres import EmbeddedPostgres
from budgetgate.devstack.redis import EmbeddedRedis
from budgetgate.devstack.redis_cluster import EmbeddedRedisCluster
from tests.support import containers

S = TypeVar("S", bound=EmbeddedServer)


@dataclass(frozen=True)
class Backend:
    url: str
    # "env", "container" or "embedded": printed in the session header, so a failure report says
    # which kind of server the tests ran against.
    origin: str


def scratch_dir(stack: ExitStack, kind: str) -> Path:
    """A private directory under the system temp dir, removed when `stack` closes.

    Not pytest's tmp_path: its parents are mode 0700, and an embedded Postgres runs as another
    user (when tests run as root) that must be able to reach its data directory.
    """
    path = Path(tempfile.mkdtemp(prefix=f"budgetgate-{kind}-"))
    stack.callback(shutil.rmtree, path, ignore_errors=True)
    return path


def run_embedded(stack: ExitStack, server: S) -> S:
    stack.callback(server.stop)
    return server.start()


def new_postgres(stack: ExitStack) -> EmbeddedPostgres:
    """A throwaway Postgres (no fsync: a killed server still recovers, only a machine crash would not)."""
    workdir = scratch_dir(stack, "postgres")
    return EmbeddedPostgres(data_dir=workdir / "data", log=workdir / "postgres.log", durable=False)


def new_redis(stack: ExitStack) -> EmbeddedRedis:
    workdir = scratch_dir(stack, "redis")
    return EmbeddedRedis(log=workdir / "redis.log", workdir=workdir)


def new_kafka(stack: ExitStack) -> TansuBroker:
    return TansuBroker(log=scratch_dir(stack, "kafka") / "kafka.log")


def postgres(stack: ExitStack) -> Backend:
    if given := os.environ.get("BUDGETGATE_POSTGRES_DSN"):
        return Backend(given, "env")
    if containers.docker_engine_available():
        return Backend(containers.postgres(stack), "container")
    return Backend(run_embedded(stack, new_postgres(stack)).dsn(), "embedded")


def new_redis_cluster(stack: ExitStack) -> EmbeddedRedisCluster:
    cluster = EmbeddedRedisCluster(scratch_dir(stack, "redis-cluster"))
    stack.callback(cluster.stop)
    return cluster.start()


def redis_on_cluster() -> bool:
    """Whether this session's Redis is a cluster (BUDGETGATE_TEST_REDIS=cluster)."""
    wanted = os.environ.get("BUDGETGATE_TEST_REDIS", "").strip().lower()
    if wanted not in ("", "single", "cluster"):
        raise ValueError(f"BUDGETGATE_TEST_REDIS={wanted!r}: say 'cluster' or 'single'")
    return wanted == "cluster"


def redis(stack: ExitStack) -> Backend:
    if redis_on_cluster():
        return Backend(new_redis_cluster(stack).url, "embedded cluster")
    if given := os.environ.get("BUDGETGATE_REDIS_URL"):
        return Backend(given, "env")
    if containers.docker_engine_available():
        return Backend(containers.redis(stack), "container")
    return Backend(run_embedded(stack, new_redis(stack)).url, "embedded")


def kafka(stack: ExitStack) -> Backend:
    if given := os.environ.get("BUDGETGATE_KAFKA_BOOTSTRAP"):
        return Backend(given, "env")
    if containers.docker_engine_available():
        return Backend(containers.kafka(stack), "container")
    return Backend(run_embedded(stack, new_kafka(stack)).url, "embedded")
