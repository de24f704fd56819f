"""The one classification of backend failures every service shares: errors meaning Postgres or
Redis is unreachable, failed mid-call or cannot take the work right now (a failover under way, out
of resources, a transaction the server rolled back to retry), so the answer is 503 (or a retry),
never a 500."""

from __future__ import annotations

import asyncpg
import redis.exceptions

BACKEND_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    # SQLSTATE class 57, operator intervention: admin shutdown (57P01, a terminated backend or
    # a server stopping), crash shutdown (57P02), cannot connect now (57P03).
    asyncpg.exceptions.OperatorInterventionError,
    # 40001 serialization failure, 40P01 deadlock: the server rolled the transaction back and
    # the same work succeeds when tried again.
    asyncpg.exceptions.TransactionRollbackError,
    # SQLSTATE class 53: disk full, out of memory, too many connections.
    asyncpg.exceptions.InsufficientResourcesError,
    # 25006: a write reached a server that is (now) a read-only standby, as after a failover.
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    redis.exceptions.ConnectionError,  # BusyLoadingError (a Redis loading its data) included
    redis.exceptions.TimeoutError,
    # READONLY: a write reached a replica (a demoted primary after a failover); OOM: maxmemory
    # reached with nothing to evict; TRYAGAIN, CLUSTERDOWN, MASTERDOWN: a cluster resharding or
    # failing over. None is a fault of the request.
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    # A Redis Cluster's client gave up routing a command: its redirects (MOVED, ASK, TRYAGAIN
    # while a slot moves) or reconnections ran out ("TTL exhausted."), or no live node serves
    # the slot (a master lost before its replica is promoted). Both pass once the cluster settles.
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
)
