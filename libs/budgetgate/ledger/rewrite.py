"""Writing Postgres's ledger into Redis for a rebuild, fenced against an older rebuild still writing.

A rebuild runs under the ledger lock (Postgres, held exclusively by its transaction), so two
rebuilds never overlap while both their sessions live. A rebuilder whose session ended while its
process went on (stalled, cut off from Postgres, its backend terminated) no longer holds the lock:
another one rebuilds meanwhile, and the first one's late writes must not land on that newer copy.

Each rebuild therefore claims the fence key with a token of its own (which also drops the loaded
marker), proves it still holds the ledger lock (`holding`, a statement on its transaction: a
session that ended fails it), and makes every later write in a MULTI/EXEC that WATCHes the fence
and runs only while the fence still holds its token. A newer rebuild can claim the fence only
once the older one's session has ended, so from its claim on nothing of the older one is
written; what the older one wrote before is deleted by the newer one's first step. The marker
goes back last, after a second proof that the lock is held.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.exceptions

from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger, refusals_as_outages

Queue = Callable[[Any], None]  # queues commands on a pipeline


class RebuildSuperseded(LedgerNotLoaded):
    """Another rebuild claimed Redis since this one did: this one stops writing."""


def fence_key(ledger: RedisLedger) -> str:
    return f"{ledger.tag}:rebuild"


async def replace_all(
    ledger: RedisLedger,
    *,
    ledgers: dict[str, tuple[int, int]],
    runs: dict[str, tuple[str, int, dict[str, int]]],
    generation: str,
    holding: Callable[[], Awaitable[object]],
    seq: int = 0,
    sizes: dict[str, int] | None = None,
    extra: Queue | None = None,
) -> None:
    """Replace everything under the ledger's prefix with Postgres's state, then mark it loaded.

    The marker goes first (in the claim) and last, so no reservation is made from a half-written
    ledger: until it is set again every script answers NOT_LOADED. The ledger sequence restarts
    at `seq`, the highest Postgres committed (see reserve.lua). `holding` raises unless the
    caller still holds the ledger lock. `sizes`: the size of each escrow lease among `ledgers`
    (budgetgate.ledger.escrow_leases), which Postgres holds. Raises RebuildSuperseded when a newer rebuild claimed
    Redis meanwhile; nothing of this one is written from then on.
    """
    client, fence, token = ledger.client, fence_key(ledger), uuid.uuid4().hex
    with refusals_as_outages():
        # A Redis Cluster client whose first command is a MULTI/EXEC fails it ("Future attached
        # to a different loop", redis-py 8.1): it finds the cluster's nodes first. A single
        # Redis's client does nothing here.
        await client.initialize()
        claim = client.pipeline(transaction=True)
        claim.set(fence, token)
        claim.delete(ledger.marker)
        await claim.execute()
        await holding()
        stale = [key async for key in client.scan_iter(match=f"{ledger.tag}:*", count=1000) if _text(key) != fence]
        for start in range(0, len(stale), 500):
            chunk = stale[start : start + 500]
            await _fenced(ledger, token, lambda pipe, chunk=chunk: pipe.delete(*chunk))

        def write(pipe: Any) -> None:
            for key, (reserved, consumed) in ledgers.items():
                figures = {"reserved": reserved, "consumed": consumed}
                if sizes and key in sizes:
                    figures["size"] = sizes[key]
                pipe.hset(ledger.ledger(key), mapping=figures)
            for run_id, (decision_id, at_ms, amounts) in runs.items():
                fields: dict[str, object] = {ledger.ledger(k): v for k, v in amounts.items()}
                pipe.hset(ledger.run(run_id), mapping={**fields, "_decision": decision_id, "_at": at_ms})
            pipe.set(ledger.sequence, seq)
            if extra is not None:
                extra(pipe)  # more state to write before the marker goes back (concurrency holds)

        await _fenced(ledger, token, write)
        await holding()
        await _fenced(ledger, token, lambda pipe: pipe.set(ledger.marker, generation))


async def _fenced(ledger: RedisLedger, token: str, queue: Queue) -> None:
    """Run the commands `queue` adds in one MULTI/EXEC, only while the fence holds `token`."""
    fence = fence_key(ledger)
    async with ledger.client.pipeline(transaction=True) as pipe:
        await pipe.watch(fence)
        if _text(await pipe.get(fence) or b"") != token:
            raise RebuildSuperseded("another rebuild of the Redis ledger took over from this one")
        pipe.multi()
        queue(pipe)
        try:
            await pipe.execute()
        except redis.exceptions.WatchError as exc:
            raise RebuildSuperseded("another rebuild of the Redis ledger took over from this one") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
