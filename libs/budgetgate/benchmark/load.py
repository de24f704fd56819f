"""The load generators: N clients on keep-alive HTTP/1.1 connections, each sending the next
submission as soon as its previous one was answered (a closed loop, `drive`); or submissions
sent at a fixed offered rate whatever the answers (an open loop, `offer`).

A few lines of asyncio streams instead of a full HTTP client: on a small machine the client
shares the cores with the services it measures, and a general-purpose client's own CPU time
would be a noticeable part of every latency.

Several `ports` are replicas of one service, driven as one: in the closed loop client k keeps its
connection to replica k mod N (as a connection-level load balancer pins a keep-alive
connection), in the open loop submission i goes to replica i mod N (round robin); which replica
answered each submission is recorded (`Outcome.served_by`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

TIMEOUT_SECONDS = 30.0


@dataclass
class Outcome:
    """What one phase of load produced."""

    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests only
    sent: list[float] = field(default_factory=list)  # when each of them was due (perf_counter)
    decisions: list[str | None] = field(default_factory=list)  # per submission; None = error
    errors: Counter[str] = field(default_factory=Counter)
    served_by: list[int | None] = field(default_factory=list)  # per submission, the replica (index into the ports) that answered it

    @classmethod
    def of(cls, count: int) -> Outcome:
        """An empty outcome for `count` submissions."""
        return cls(decisions=[None] * count, served_by=[None] * count)

    @property
    def answered(self) -> int:
        return len(self.latencies)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def count(self, decision: str) -> int:
        return sum(d == decision for d in self.decisions)

    def answered_by(self, replicas: int) -> list[int]:
        """How many submissions each of `replicas` replicas answered."""
        counts = Counter(r for r in self.served_by if r is not None)
        return [counts[r] for r in range(replicas)]

    def percentile_ms(self, p: float) -> float | None:
        """Nearest-rank percentile of the answered requests' latencies, in milliseconds."""
        if not self.latencies:
            return None
        return _percentile_ms(self.latencies, p)

    def percentile_ms_by_window(self, p: float, seconds: float) -> list[float | None]:
        """The percentile of the requests due in each `seconds` from the first one (None for a
        window without an answer): a latency that grows with the run shows here, where the
        percentile of the whole run hides it."""
        if not self.sent:
            return []
        first = min(self.sent)
        windows: list[list[float]] = [[] for _ in range(int((max(self.sent) - first) // seconds) + 1)]
        for due, latency in zip(self.sent, self.latencies, strict=True):
            windows[int((due - first) // seconds)].append(latency)
        return [_percentile_ms(w, p) for w in windows]


def _percentile_ms(latencies: list[float], p: float) -> float | None:
    """Nearest-rank percentile of `latencies` (seconds), in milliseconds."""
    if not latencies:
        return None
    ordered = sorted(latencies)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1] * 1000


class _Connection:
    def __init__(self, host: str, port: int, token: str | None = None, *, replica: int = 0) -> None:
        self.host, self.port, self.replica = host, port, replica
        self.authorization = f"Authorization: Bearer {token}\r\n" if token else ""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{self.authorization}Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line, *header_lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines if line)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            payload = await self._chunked()
        else:
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return int(status_line.split(" ", 2)[1]), payload

    async def _chunked(self) -> bytes:
        assert self.reader is not None
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


async def _send(connection: _Connection, path: str, body: bytes, outcome: Outcome, i: int, started: float) -> bool:
    """Send one body and record its answer; False when the connection is no longer usable."""
    try:
        async with asyncio.timeout(TIMEOUT_SECONDS):
            status, payload = await connection.post(path, body)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError) as exc:
        outcome.errors[type(exc).__name__] += 1
        await connection.close()
        return False
    if status != 200:
        outcome.errors[f"HTTP {status}"] += 1
        return True
    outcome.latencies.append(time.perf_counter() - started)
    outcome.sent.append(started)
    outcome.decisions[i] = json.loads(payload)["decision"]
    outcome.served_by[i] = connection.replica
    return True


async def offer(
    *, host: str, ports: Sequence[int], bodies: Sequence[bytes], rate: float, path: str = "/v1/admissions", max_connections: int = 512, token: str | None = None
) -> Outcome:
    """Send body i at i / `rate` seconds after the start, whether or not earlier ones were
    answered (an open loop: a slow answer does not slow the offered load), to replica i mod N of
    `ports`. Latency counts from the moment a submission was due, so time spent queued behind a
    slow server (or waiting for one of a replica's `max_connections` connections) is included."""
    outcome = Outcome.of(len(bodies))
    idle: list[asyncio.Queue[_Connection]] = [asyncio.Queue() for _ in ports]
    opened = [0] * len(ports)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int, due: float) -> None:
        replica = i % len(ports)
        if idle[replica].empty() and opened[replica] < max_connections:
            opened[replica] += 1
            connection = _Connection(host, ports[replica], token, replica=replica)
        else:
            connection = await idle[replica].get()
        await _send(connection, path, bodies[i], outcome, i, due)
        idle[replica].put_nowait(connection)  # closed after an error; it reconnects on its next use

    start = time.perf_counter()
    for i in range(len(bodies)):
        due = start + i / rate
        # Behind schedule, still yield, so the requests already due get sent and answered.
        await asyncio.sleep(max(due - time.perf_counter(), 0))
        task = loop.create_task(one(i, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    outcome.elapsed = time.perf_counter() - start
    for queue in idle:
        while not queue.empty():
            await queue.get_nowait().close()
    return outcome


async def drive(
    *, host: str, ports: Sequence[int], bodies: Sequence[bytes], concurrency: int, path: str = "/v1/admissions", token: str | None = None
) -> Outcome:
    """Send every body once with `concurrency` clients, client k to replica k mod N of `ports`;
    errors are counted, never retried."""
    outcome = Outcome.of(len(bodies))
    next_index = iter(range(len(bodies)))

    async def client(k: int) -> None:
        connection = _Connection(host, ports[k % len(ports)], token, replica=k % len(ports))
        try:
            for i in next_index:
                await _send(connection, path, bodies[i], outcome, i, time.perf_counter())
        finally:
            await connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(max(1, min(concurrency, len(bodies))))))
    outcome.elapsed = time.perf_counter() - started
    return outcome
