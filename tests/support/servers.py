"""A budgetgate service running in the test's event loop on a free port, with an HTTP client."""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import threading
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import httpx
import uvicorn

from budgetgate.runtime.settings import ServingSettings

from tests.support.waiting import wait_for


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every test client: httpx loads the CA bundle for each client made
    without one (about 26 ms of CPU), though these talk plain HTTP to 127.0.0.1."""
    return httpx.create_ssl_context()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PageServer:
    """A loopback HTTP server (its own thread) answering every GET with `page(path)`: (body,
    content type). `url` is its base; `close()` stops it."""

    def __init__(self, page: Callable[[str], tuple[bytes, str]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body, content_type = page(self.path)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class InProcessServer:
    """Serves `app` with uvicorn (lifespan on) and talks to it over real HTTP. With `dsn`, its
    client carries a token of every role made in that database (authentication is always on)."""

    name = "service"

    def __init__(self, app: Any, *, port: int, dsn: str | None = None) -> None:
        self.app = app
        self.dsn = dsn
        self.token: str | None = None
        self.url = f"http://127.0.0.1:{port}"
        # Idle connections kept as the services keep them (ServingSettings): longer than the
        # client's 5 s, or a request sent as the server closes an idle connection fails unanswered.
        keep_alive = ServingSettings.model_fields["http_keep_alive_seconds"].default
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", proxy_headers=False, timeout_keep_alive=keep_alive)
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None
        self.client = httpx.AsyncClient(base_url=self.url, timeout=30, verify=_tls())

    @property
    def rt(self) -> Any:
        return self.app.state.rt

    async def start(self) -> None:
        if self.dsn is not None and self.token is None:
            from tests.support.principals import bearer, issue

            self.token = await issue(self.dsn)
            self.client.headers.update(bearer(self.token))
        self.task = asyncio.create_task(self.server.serve())
        await wait_for(self._serving, timeout=30, what=f"{self.name} listening on {self.url}")

    def _serving(self) -> bool:
        assert self.task is not None
        if self.task.done():
            self.task.result()  # it failed to start: its error, not a timeout
        return self.server.started

    async def wait_ready(self, timeout: float = 30) -> None:
        last: list[str] = []

        async def ready() -> bool:
            response = await self.client.get("/readyz")
            last[:] = [response.text]
            return response.status_code == 200

        try:
            await wait_for(ready, timeout=timeout, what=f"{self.name} ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; /readyz said: {last[0] if last else 'nothing'}") from None

    async def stop(self) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        if self.task is not None:
            await self.task


S = TypeVar("S", bound=InProcessServer)


@contextlib.asynccontextmanager
async def started_servers(settings: Any, build: Callable[[dict[str, Any]], S], **defaults: Any) -> AsyncIterator[Callable[..., Awaitable[S]]]:
    """`start(**overrides)`: a server built by `build` from the test's settings, a free port, no
    rate limit, `defaults`, then `overrides`; every one started is stopped when the block ends."""
    servers: list[S] = []

    async def start(**overrides: Any) -> S:
        server = build({**settings.model_dump(), "port": free_port(), "rate_limit": None, **defaults, **overrides})
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()
