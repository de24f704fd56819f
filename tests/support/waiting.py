"""Waiting for an effect (a message consumed, a row written, a server up, a lease run out): poll
the condition itself until it holds, with a deadline, never sleep "long enough" and hope.

`wait_for` in async tests, `wait_for_sync` in sync ones (a subprocess to watch, no event loop).
Both return what the condition returned, so a condition may hand back what it found. A
condition may raise to end the wait at once (a process that died will never be ready).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_SECONDS = 0.05  # often enough that a test waits little past the effect, rarely enough to load nothing


def _timed_out(what: str, timeout: float) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}")


async def wait_for(condition: Callable[[], T | Awaitable[T]], *, timeout: float = 60, what: str, interval: float = POLL_SECONDS) -> T:
    """Call `condition()` (sync or async) until it returns something truthy and return that;
    fail the test, naming `what`, once `timeout` seconds have passed without it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _timed_out(what, timeout)
        await asyncio.sleep(interval)  # the poll interval


def wait_for_sync(condition: Callable[[], T], *, timeout: float = 60, what: str, interval: float = POLL_SECONDS) -> T:
    """`wait_for` for sync code: blocks the thread between calls of `condition()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout)
        time.sleep(interval)  # the poll interval
