"""The `budgetgate` command line run as a user runs it: a subprocess in a folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def budgetgate(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "budgetgate.cli.main", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
