"""Child processes of the local stack: spawn them, recognise them later, stop them.

`dev down` runs in another process than `dev up`, so it acts on a `ProcessRecord` (pid and exact
command line) rather than on a Popen handle. The command line is compared before any signal is
sent, so a pid the kernel has since given to an unrelated program is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ProcessRecord:
    """What `dev up` started, as written to `.budgetgate/dev.json`."""

    name: str
    pid: int
    cmdline: list[str]
    log: str
    # Only for an embedded Postgres: its data directory, so `down` can use `pg_ctl stop`.
    pgdata: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: v for k, v in data.items() if v not in (None, {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            cmdline=[str(a) for a in data["cmdline"]],
            log=str(data["log"]),
            pgdata=data.get("pgdata"),
            extra=dict(data.get("extra", {})),
        )


def read_cmdline(pid: int) -> list[str] | None:
    """The command line of a live, non-zombie process; None when there is no such process."""
    proc = Path("/proc") / str(pid)
    try:
        stat = (proc / "stat").read_text()
        raw = (proc / "cmdline").read_bytes()
    except OSError:
        return None
    # The state letter follows the command name, which may itself contain spaces and parentheses.
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return None
    return [os.fsdecode(arg) for arg in raw.rstrip(b"\0").split(b"\0")] if raw else []


def is_running(record: ProcessRecord) -> bool:
    """True when the pid is alive, not a zombie, and still runs the recorded command line."""
    return read_cmdline(record.pid) == record.cmdline


def spawn(
    cmd: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session with stdout and stderr appended to `log`.

    Its own session: a Ctrl-C in the terminal of `dev up` reaches only `dev up`, which then stops
    the children in order; and the whole process group can be signalled at once (a Postgres
    postmaster and its backends, a service and any workers it forks).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    as_user: dict[str, Any] = {}
    if user is not None:
        import pwd

        entry = pwd.getpwnam(user)
        as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            **as_user,
        )


def send_signal(pid: int, sig: int) -> None:
    """Signal the process group when the process leads one (as everything `spawn` starts does)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_gone(record: ProcessRecord, timeout: float) -> bool:
    """Wait until the recorded process is gone; True if it went within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        _reap(record.pid)
        if not is_running(record):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def terminate(record: ProcessRecord, *, timeout: float = 10.0, first: int = signal.SIGTERM) -> bool:
    """Stop the recorded process: `first` signal, then SIGKILL after `timeout` seconds.

    Returns False, and signals nothing, when the pid no longer runs the recorded command line.
    """
    if not is_running(record):
        return False
    send_signal(record.pid, first)
    if not wait_gone(record, timeout):
        send_signal(record.pid, signal.SIGKILL)
        wait_gone(record, 5.0)
    return True


def wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no live process is left in process group `pgid`."""
    deadline = time.monotonic() + timeout
    while _group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        # fields[0] is the state, fields[2] the process group id.
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _reap(pid: int) -> None:
    # A child of this very process stays a zombie until waited for; `is_running` already treats
    # zombies as gone, this only keeps the process table clean in foreground `dev up`.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def log_tail(path: Path, *, lines: int = 20, since: int = 0) -> str:
    """The last `lines` lines of a log file, from byte offset `since` on."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except OSError:
        return f"(no log at {path})"
    text = data.decode(errors="replace").rstrip("\n")
    return "\n".join(text.splitlines()[-lines:]) if text else "(log is empty)"
