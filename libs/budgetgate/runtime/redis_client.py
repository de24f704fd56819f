"""The Redis client of the ledger's users (admission, the reconciler, the CLI): redis-py's asyncio
client, with each command packed into the wire protocol by hiredis (C) instead of redis-py's
asyncio packer (Python). The rate limiter's client is the `limits` library's own.

redis-py's synchronous client already packs with hiredis when it is installed; its asyncio client
does not, and packs argument by argument in Python. Admission's check-and-reserve script takes a
few keys and arguments per decision, so a batch of 16 is one command of about 250 keys and
arguments: packing it in Python cost about 280 µs, hiredis about 80 µs (timeit), on the one core the
admission process runs on. The bytes sent are the same (tests/unit/test_redis_client.py).
"""

from __future__ import annotations

import functools
from typing import Any

import redis.asyncio as aioredis
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

__all__ = ["connect"]


def connect(url: str, **options: Any) -> aioredis.Redis:
    """`redis.asyncio.from_url(url, **options)`, packing its commands with hiredis when it is
    installed (a dependency of budgetgate's, redis[hiredis])."""
    client = aioredis.from_url(url, **options)
    pool = client.connection_pool
    if HIREDIS_AVAILABLE:
        pool.connection_class = _packed_by_hiredis(pool.connection_class)  # TCP, TLS or a socket
    return client


class _HiredisPacking:
    _serializer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._serializer.pack(*args)


@functools.cache
def _packed_by_hiredis(base: type) -> type:
    return type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
