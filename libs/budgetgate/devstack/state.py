"""The state file of a local stack, `.budgetgate/dev.json`, and the lock around changing it.

`CommonSettings` reads the "settings" part, so every command run in the checkout reaches the
stack without configuration; `dev status` and `dev down` read the "processes" part.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from budgetgate.devstack.processes import ProcessRecord, is_running
from budgetgate.runtime.settings import DEV_STATE_FILE

STATE_VERSION = 1


def state_dir(root: Path) -> Path:
    return root / DEV_STATE_FILE.parent


def state_path(root: Path) -> Path:
    return root / DEV_STATE_FILE


@dataclass
class StackState:
    """Settings a stack publishes and the processes it owns, in start order."""

    root: Path
    settings: dict[str, str | None] = field(default_factory=dict)
    processes: list[ProcessRecord] = field(default_factory=list)
    # Settings derived from a BUDGETGATE_* variable (setting -> the variable's value then): the
    # variable named a shared server, the setting is this checkout's room on it.
    from_env: dict[str, str] = field(default_factory=dict)
    # Set once `dev up` has finished; a stack left incomplete was abandoned by a `dev up` that
    # died midway (one still running would hold the lock).
    complete: bool = False
    # One API token per role for this stack (role -> secret); the file is readable by its owner only.
    tokens: dict[str, str] = field(default_factory=dict)

    def add(self, record: ProcessRecord) -> None:
        """Remember a started process, on disk at once, so a crash of `dev up` leaves nothing unowned."""
        self.processes.append(record)
        self.save()

    def put(self, record: ProcessRecord) -> None:
        """Remember a process, replacing the record of the same name (a server started again, or
        recorded at its spawn and again once it answers), on disk at once."""
        self.processes = [p for p in self.processes if p.name != record.name] + [record]
        self.save()

    def alive(self) -> dict[str, bool]:
        return {p.name: is_running(p) for p in self.processes}

    def save(self) -> None:
        path = state_path(self.root)
        path.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {
            "version": STATE_VERSION,
            "root": str(self.root),
            "settings": self.settings,
            "processes": [p.to_json() for p in self.processes],
            "from_env": self.from_env,
            "complete": self.complete,
            "tokens": self.tokens,
        }
        # Write then rename: a reader (CommonSettings in another process) never sees half a file.
        # Created 0600: the file holds API tokens (and the DSN, with any password it has).
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data, indent=2) + "\n")
        os.chmod(tmp, 0o600)
        tmp.replace(path)

    @classmethod
    def load(cls, root: Path) -> StackState | None:
        """The recorded stack of `root`, or None when there is none (or the file is unreadable)."""
        try:
            data = json.loads(state_path(root).read_text())
            return cls(
                root=root,
                settings=dict(data.get("settings", {})),
                processes=[ProcessRecord.from_json(p) for p in data.get("processes", [])],
                from_env=dict(data.get("from_env", {})),
                complete=bool(data.get("complete", False)),
                tokens=dict(data.get("tokens", {})),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateFileError(f"{state_path(root)} is unreadable ({exc}); remove it by hand") from exc

    @staticmethod
    def remove(root: Path) -> None:
        state_path(root).unlink(missing_ok=True)


class StateFileError(RuntimeError):
    """The state file exists but cannot be understood."""


@contextmanager
def stack_lock(root: Path) -> Iterator[None]:
    """Serialise `up` and `down` of one checkout (two terminals, or a test and a developer)."""
    directory = state_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "dev.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
