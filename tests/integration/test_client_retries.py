"""budgetgate.client's resends against a real local HTTP server that answers as scripted: a 429
is resent like a 503, and a Retry-After is honoured whole, never cut to the policy's max_wait;
a wait that does not fit in the deadline raises instead of resending early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from budgetgate.client import AsyncClient, Client, RateLimited, RetryPolicy, Unavailable
from budgetgate.client import calls
from budgetgate.client.errors import retry_after
from tests.support.servers import InProcessServer, free_port

# Backoff alone would resend within 0.06 s: any longer gap is the server's Retry-After.
QUICK = RetryPolicy(attempts=4, initial=0.01, max_wait=0.05, deadline=10)


class Scripted:
    """A service whose first answers are the scripted refusals (status, Retry-After, or a function
    making it when the refusal is answered), then readiness; `arrivals` is when each request came
    in (monotonic seconds)."""

    def __init__(self, *refusals: tuple[int, str | Callable[[], str]]) -> None:
        self.refusals = list(refusals)
        self.arrivals: list[float] = []
        self.app = FastAPI()

        @self.app.get("/readyz")
        async def readyz() -> JSONResponse:
            self.arrivals.append(time.monotonic())
            if self.refusals:
                status, asked = self.refusals.pop(0)
                asked = asked() if callable(asked) else asked
                return JSONResponse({"detail": f"refused with {status}"}, status_code=status, headers={"Retry-After": asked})
            return JSONResponse({"status": "ready", "checks": {"ledger": "ok"}})

    def gaps(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.arrivals, self.arrivals[1:], strict=False)]


@pytest.fixture
async def serve() -> AsyncIterator:  # type: ignore[type-arg]
    servers: list[InProcessServer] = []

    async def start(*refusals: tuple[int, str | Callable[[], str]]) -> tuple[Scripted, str]:
        scripted = Scripted(*refusals)
        server = InProcessServer(scripted.app, port=free_port())
        await server.start()
        servers.append(server)
        return scripted, server.url

    yield start
    for server in servers:
        await server.stop()


async def test_a_429_is_resent_no_sooner_than_its_retry_after(serve) -> None:
    scripted, url = await serve((429, "1"))
    async with AsyncClient(url, token="t", retry=QUICK) as client:
        assert await client.send(calls.readiness()) == {"ledger": "ok"}
    assert len(scripted.arrivals) == 2 and scripted.gaps()[0] >= 0.95


async def test_the_sync_client_resends_a_429_the_same_way(serve) -> None:
    scripted, url = await serve((429, "1"))

    def ask() -> dict[str, str]:
        with Client(url, token="t", retry=QUICK) as client:
            return client.send(calls.readiness())

    # The server runs on this test's event loop; the blocking client runs beside it.
    assert await asyncio.to_thread(ask) == {"ledger": "ok"}
    assert len(scripted.arrivals) == 2 and scripted.gaps()[0] >= 0.95


async def test_a_retry_after_longer_than_max_wait_is_waited_whole(serve) -> None:
    scripted, url = await serve((503, "1"), (503, "1"))
    async with AsyncClient(url, token="t", retry=QUICK) as client:
        assert await client.send(calls.readiness()) == {"ledger": "ok"}
    assert len(scripted.arrivals) == 3 and all(gap >= 0.95 for gap in scripted.gaps())


async def test_a_retry_after_past_the_deadline_is_raised_not_resent_early(serve) -> None:
    scripted, url = await serve((503, "30"), (429, "30"))
    policy = RetryPolicy(attempts=5, initial=0.01, max_wait=0.05, deadline=5)
    async with AsyncClient(url, token="t", retry=policy) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as unavailable:
            await client.send(calls.readiness())
        with pytest.raises(RateLimited) as limited:
            await client.send(calls.readiness())
        took = time.monotonic() - started
    assert unavailable.value.retry_after == 30.0 and limited.value.retry_after == 30.0 and limited.value.status == 429
    assert len(scripted.arrivals) == 2 and took < 2.0  # one send each: no early resend, no 30 s wait


async def test_a_retry_after_given_as_an_http_date_is_waited(serve) -> None:
    # The date is made when the refusal is answered (under load the first request came more than a
    # second after the test began, and a date made then was less than a second ahead).
    scripted, url = await serve((429, lambda: format_datetime(datetime.now(UTC) + timedelta(seconds=2), usegmt=True)))
    async with AsyncClient(url, token="t", retry=QUICK) as client:
        assert await client.send(calls.readiness()) == {"ledger": "ok"}
    assert len(scripted.arrivals) == 2 and scripted.gaps()[0] >= 0.95  # the date has whole seconds: at least 1 s of the 2


def test_retry_after_reads_seconds_and_dates() -> None:
    now = datetime(2026, 7, 14, 9, 30, tzinfo=UTC)
    assert retry_after("30") == 30.0 and retry_after(" 1.5 ") == 1.5
    assert retry_after("Tue, 14 Jul 2026 09:30:45 GMT", now=now) == 45.0
    assert retry_after("Tue, 14 Jul 2026 09:29:00 GMT", now=now) == 0.0  # a date past: now
    assert retry_after("") is None and retry_after("soon") is None and retry_after("-5") is None
