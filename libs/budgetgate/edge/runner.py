"""The one runner of every budgetgate service: what each service's `create_app` used to do by hand
in its app's lifespan, in one place.

A service is an object (`Service`, in its `service.py`) built from its settings when its app
starts; the runner (`service_app`) then starts its background work (its outbox relay, where it
has one, and its own loops), serves `/healthz`, `/readyz` (from `service.checks()`) and
`/metrics` (`operational_routes`), and on shutdown stops every task and closes every client
within bounded time, so a server that went away never keeps a service from stopping. uvicorn
turns SIGTERM and SIGINT into that shutdown (`budgetgate.edge.serving.serve`).

While the app runs, the service is `app.state.rt`: the routes find it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI, Request

from budgetgate.contracts.operations import Operation
from budgetgate.edge.serving import add_operational_routes, stop_tasks
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.runtime.telemetry import Telemetry


class Service:
    """What a service holds while it runs. A service says what it runs in the background
    (`loops()`, and `outbox_relay` for the runner to serve), what `/readyz` checks (`checks()`,
    and `details()` reported beside them, never required) and how its clients close (`close()`);
    `start()` and `stop()` are the runner's, the same for every service."""

    # The relay the runner serves: its producer connected (waiting for Kafka as long as it takes),
    # then relaying until the service stops. None: the service has no outbox, or relays it itself.
    outbox_relay: OutboxRelay | None = None
    tasks: list[asyncio.Task[None]]

    def loops(self) -> Mapping[str, Coroutine[Any, Any, None]]:
        """The service's background work, by task name; each runs until the service stops."""
        return {}

    async def start(self) -> None:
        """Start the background tasks: the outbox relay, then `loops()`."""
        work: dict[str, Coroutine[Any, Any, None]] = {}
        if self.outbox_relay is not None:
            work["outbox-relay"] = self.outbox_relay.serve()
        work.update(self.loops())
        self.tasks = [asyncio.create_task(loop, name=name) for name, loop in work.items()]

    async def checks(self) -> dict[str, str]:
        """Each readiness check and what it found: "ok", or why not."""
        raise NotImplementedError

    def details(self) -> dict[str, Any]:
        """More for `/readyz` to show beside the checks (never required to be ready)."""
        return {}

    async def close(self) -> None:
        """Close the service's clients, each within bounded time (see serving.close_within)."""

    async def stop(self) -> None:
        """Stop the background tasks (each given a bounded wait), then close the clients."""
        tasks, self.tasks = getattr(self, "tasks", []), []
        await stop_tasks(tasks)
        await self.close()


def service_app(*, title: str, build: Callable[[], Service | Awaitable[Service]], **fastapi: Any) -> FastAPI:
    """The FastAPI app of a service: `build()` makes the service (or a coroutine making it, when
    building it opens connections) when the app starts, which is
    then started (`app.state.rt`) and stopped when the app stops. The service's `create_app` adds
    its middleware and routes, and `operational_routes`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        built = build()
        service = await built if inspect.isawaitable(built) else built
        app.state.rt = service
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    return FastAPI(title=title, version="1", lifespan=lifespan, **fastapi)


def operational_routes(app: FastAPI, *, telemetry: Telemetry, operations: Mapping[str, Operation] | None = None, protect_metrics: bool = False) -> None:
    """`/healthz`, `/readyz` from the running service's `checks()` (and its `details()`),
    `/metrics`, problem details and the published OpenAPI (serving.add_operational_routes)."""

    async def readiness(request: Request) -> dict[str, str]:
        return await request.app.state.rt.checks()

    def details(request: Request) -> dict[str, Any]:
        return request.app.state.rt.details()

    add_operational_routes(app, telemetry=telemetry, readiness=readiness, details=details, operations=operations, protect_metrics=protect_metrics)
