"""The ledger's side of a DELAY's next eligible time: what Postgres knows about how each ledger
key's usage changes with time alone (see budgetgate.core.eligibility)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta

import asyncpg

from budgetgate.core.eligibility import Held, Outlook
from budgetgate.core.evaluation import Charge
from budgetgate.ledger.queries import sql


async def outlooks(conn: asyncpg.Connection, charges: Sequence[Charge], *, start_deadline: timedelta) -> dict[str, Outlook]:
    """The outlook of the ledger key of each charge, in two queries whatever their number; the
    rows are summed per instant in SQL, so a hot budget's many holds come back as few rows."""
    keys = sorted({c.ledger_key for c in charges})
    if not keys:
        return {}
    rolling = sorted({c.ledger_key for c in charges if c.policy.window.rolling})
    holds: dict[str, list[Held]] = defaultdict(list)
    for row in await conn.fetch(sql("outlook_holds"), keys, start_deadline.total_seconds()):
        # Summed per instant: a started hold's instant is its expected end, an unstarted one's its deadline.
        at = row["at"]
        holds[row["ledger_key"]].append(Held(row["amount"], row["started"], start_deadline=at, expected_end=at))
    buckets: dict[str, list[tuple]] = defaultdict(list)
    if rolling:
        for row in await conn.fetch(sql("outlook_buckets"), rolling):
            buckets[row["ledger_key"]].append((row["bucket"], row["amount"]))
    return {key: Outlook(tuple(holds[key]), tuple(sorted(buckets[key]))) for key in keys}
