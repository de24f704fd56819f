"""redis_client.connect packs commands with hiredis: the same bytes redis-py's own asyncio packer
sends, for every kind of argument budgetgate sends, over TCP, TLS and a Unix socket alike."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from budgetgate.runtime import redis_client

arguments = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
)


@given(name=st.sampled_from(["EVALSHA", "SET", "CLIENT SETNAME", b"HSET"]), args=st.lists(arguments, max_size=300))
def test_hiredis_packs_the_bytes_redis_py_packs(name: str | bytes, args: list[object]) -> None:
    ours = redis_client._packed_by_hiredis(Connection)()
    theirs = Connection()
    assert b"".join(ours.pack_command(name, *args)) == b"".join(theirs.pack_command(name, *args))


@pytest.mark.parametrize("bad", [True, None, [1]])
def test_what_redis_py_refuses_is_refused(bad: object) -> None:
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError):
        redis_client._packed_by_hiredis(Connection)().pack_command("SET", "k", bad)


@pytest.mark.parametrize(
    ("url", "base"),
    [("redis://127.0.0.1:6379/0", Connection), ("rediss://127.0.0.1:6380/0", SSLConnection), ("unix:///run/redis.sock", UnixDomainSocketConnection)],
)
async def test_the_client_keeps_its_transport(url: str, base: type) -> None:
    client = redis_client.connect(url, socket_timeout=5)
    try:
        kind = client.connection_pool.connection_class
        assert issubclass(kind, base) and issubclass(kind, redis_client._HiredisPacking)
        assert client.connection_pool.connection_kwargs["socket_timeout"] == 5
        assert isinstance(client, aioredis.Redis)
    finally:
        await client.aclose()
