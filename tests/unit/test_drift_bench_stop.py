"""How `bench drift` ends its check loop when a phase's load ends (finish_checking): the check in
progress counts, and a check that raised fails the benchmark instead of reading as none done."""

from __future__ import annotations

import asyncio

import pytest

from budgetgate.benchmark.drift_runner import finish_checking


class Loop:
    """A drift check loop whose checks take `seconds` each, and fail from check `fail_at` on."""

    def __init__(self, seconds: float, fail_at: int | None = None) -> None:
        self.seconds, self.fail_at, self.checks, self.stop = seconds, fail_at, 0, asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(self.seconds)
            if self.fail_at is not None and self.checks + 1 >= self.fail_at:
                raise ConnectionError("Postgres went away")
            self.checks += 1


async def test_the_check_in_progress_when_the_load_ends_is_counted() -> None:
    loop = Loop(seconds=0.3)
    checker = asyncio.create_task(loop.run())
    await asyncio.sleep(0.05)  # the load ended before the first check did
    loop.stop.set()
    await finish_checking(checker, done=lambda: loop.checks)
    assert loop.checks == 1 and checker.done()


async def test_a_check_that_raised_fails_with_the_count_and_the_reason() -> None:
    loop = Loop(seconds=0.01, fail_at=3)
    checker = asyncio.create_task(loop.run())
    await asyncio.sleep(0.2)
    loop.stop.set()
    with pytest.raises(RuntimeError, match=r"the drift check failed after 2 check\(s\): ConnectionError\('Postgres went away'\)"):
        await finish_checking(checker, done=lambda: loop.checks)


async def test_a_check_longer_than_the_grace_is_cancelled() -> None:
    loop = Loop(seconds=30)
    checker = asyncio.create_task(loop.run())
    await asyncio.sleep(0.01)  # (its first check under way)
    loop.stop.set()
    await finish_checking(checker, done=lambda: loop.checks, grace=0.05)
    assert checker.cancelled() and loop.checks == 0
