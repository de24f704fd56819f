"""The `budgetgate` command line run as a user runs it: a subprocess in a folder."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def budgetgate(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "budgetgate.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


async def budgetgate_on(
    settings: Any, *args: str, cwd: Path, timeout: float = 120, variables: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`budgetgate ARGS` on the test's Postgres, Redis and Redis prefix, named by BUDGETGATE_*
    variables and by nothing else but `variables` (no other BUDGETGATE_* variable is passed on;
    `cwd` should hold no .budgetgate/dev.json), run off the event loop so the test's services
    keep running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETGATE_")}
    env.update(BUDGETGATE_POSTGRES_DSN=settings.postgres_dsn, BUDGETGATE_REDIS_URL=settings.redis_url, BUDGETGATE_REDIS_PREFIX=settings.redis_prefix)
    env.update(variables or {})
    command = [sys.executable, "-m", "budgetgate.cli.main", *args]
    return await asyncio.to_thread(subprocess.run, command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
