"""The frame every benchmark run lives in: a log folder, an exit stack for what it starts, and
clean-up that also happens on SIGTERM/SIGHUP or an error."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol


class Killable(Protocol):
    def kill(self) -> None: ...


@contextlib.asynccontextmanager
async def session(children: Sequence[Killable]) -> AsyncIterator[tuple[contextlib.AsyncExitStack, Path]]:
    """Yields (exit stack, log folder). SIGTERM/SIGHUP cancel the run so the stack unwinds;
    `children` still alive afterwards (clean-up cut short) are killed."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)
    log_dir = Path(tempfile.mkdtemp(prefix="budgetgate-bench-"))
    try:
        async with contextlib.AsyncExitStack() as stack:
            yield stack, log_dir
    finally:
        for child in children:
            child.kill()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        shutil.rmtree(log_dir, ignore_errors=True)
