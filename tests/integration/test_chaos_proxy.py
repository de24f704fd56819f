"""The fault campaign's TCP proxy (budgetgate.chaos.tcp_proxy) against a real echo server:
passes bytes, cuts, delays, black-holes and heals, and follows a new upstream."""

from __future__ import annotations

import asyncio
import time

import pytest

from budgetgate.chaos.tcp_proxy import TcpProxy


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _round_trip(port: int, payload: bytes = b"ping", timeout: float = 2.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), timeout)
    finally:
        writer.close()


async def test_the_proxy_passes_cuts_delays_black_holes_and_heals() -> None:
    server = await _echo_server()
    proxy = await TcpProxy("test", upstream=("127.0.0.1", server.sockets[0].getsockname()[1])).start()
    try:
        assert await _round_trip(proxy.port) == b"ping"

        # An open connection is cut, and new ones are refused until healed.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"a")
        assert await reader.readexactly(1) == b"a"
        proxy.cut()
        assert await asyncio.wait_for(reader.read(10), 2) == b""
        writer.close()
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await _round_trip(proxy.port)
        proxy.heal()
        assert await _round_trip(proxy.port) == b"ping"

        proxy.slow(300)
        began = time.monotonic()
        assert await _round_trip(proxy.port) == b"ping"
        assert time.monotonic() - began >= 0.55, "delayed each way"
        proxy.heal()

        # A black hole holds the bytes; healed, they flow on the same connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.black_hole()
        writer.write(b"held")
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.5)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
        writer.close()
    finally:
        await proxy.close()
        server.close()


async def test_the_proxy_follows_a_new_upstream() -> None:
    first, second = await _echo_server(), await _echo_server()
    proxy = await TcpProxy("test", upstream=("127.0.0.1", first.sockets[0].getsockname()[1])).start()
    try:
        assert await _round_trip(proxy.port) == b"ping"
        first.close()
        await first.wait_closed()
        proxy.redirect(("127.0.0.1", second.sockets[0].getsockname()[1]))
        assert await _round_trip(proxy.port) == b"ping"
    finally:
        await proxy.close()
        second.close()
