"""A small TCP proxy between one service and one store, to cut, delay or black-hole the link.

- cut: every open connection is closed at once, and new ones are closed as soon as accepted,
  until healed;
- delay: every chunk waits `delay_ms` before it is passed on, until healed;
- black hole: nothing is passed on either way (bytes stay unread, as behind a partition where
  the kernel keeps retransmitting) until healed, when the flow resumes.

The upstream address can be changed while it runs (a Redis failover): new connections go to the
new address, open ones are closed so their clients reconnect there.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 65536


class TcpProxy:
    def __init__(self, name: str, *, upstream: tuple[str, int]) -> None:
        self.name = name
        self.upstream = upstream
        self.mode = "pass"
        self.delay = 0.0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not started"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._flowing.set()
        self._drop_all()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    def cut(self) -> None:
        self.mode = "cut"
        self._drop_all()

    def slow(self, delay_ms: float) -> None:
        self.mode = "delay"
        self.delay = delay_ms / 1000.0

    def black_hole(self) -> None:
        self.mode = "blackhole"
        self._flowing.clear()

    def heal(self) -> None:
        self.mode = "pass"
        self.delay = 0.0
        self._flowing.set()

    def redirect(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._drop_all()

    def _drop_all(self) -> None:
        for client, server in list(self._links):
            for writer in (client, server):
                _abort(writer)
        self._links.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            pass  # the proxy is closing
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), timeout=5.0)
        except (OSError, TimeoutError):
            _abort(writer)
            return
        link = (writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._links.discard(link)
            for w in link:
                _abort(w)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                if self.delay:
                    await asyncio.sleep(self.delay)
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Drop the connection at once (no FIN handshake), and mark the writer closed."""
    with contextlib.suppress(Exception):
        writer.transport.abort()
    with contextlib.suppress(Exception):
        writer.close()
