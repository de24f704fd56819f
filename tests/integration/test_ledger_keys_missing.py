"""The Redis ledger names every key a call lacks, not only the first: a caller that loads them
and tries again (the reconciler's settlement) then needs one more try, whatever their number."""

from __future__ import annotations

import pytest

from budgetgate.ledger.redis_ledger import KeyChange, LedgerKeyMissing, RedisLedger
from budgetgate.runtime import redis_client

KEYS = [f"team=t{i}|2026-11-01T00:00:00Z/2026-12-01T00:00:00Z|gpu_hours" for i in range(4)]


async def test_consume_and_settle_begin_name_every_key_redis_lacks_and_change_nothing(redis_url: str, redis_prefix: str) -> None:
    client = redis_client.connect(redis_url)
    ledger = RedisLedger(client, prefix=redis_prefix)
    try:
        await client.set(ledger.marker, "test")  # loaded (as a rebuild leaves it)
        await ledger.load_key(KEYS[1], reserved=0, consumed=5)
        with pytest.raises(LedgerKeyMissing) as consumed:
            await ledger.consume({key: 1 for key in KEYS})
        assert consumed.value.ledger_keys == (KEYS[0], KEYS[2], KEYS[3]) and consumed.value.ledger_key == KEYS[0]
        with pytest.raises(LedgerKeyMissing) as settled:
            changes = [KeyChange(key, consumed=1) for key in reversed(KEYS)]
            await ledger.settle_begin(run_id="r", decision_id="d", seq=1, token="t", changes=changes, drop_run=True, now_ms=0)
        assert settled.value.ledger_keys == (KEYS[3], KEYS[2], KEYS[0])
        assert await ledger.readings([KEYS[1]]) == {KEYS[1]: (0, 5)}  # nothing changed
        for key in (KEYS[0], KEYS[2], KEYS[3]):
            await ledger.load_key(key, reserved=0, consumed=0)
        await ledger.consume({key: 1 for key in KEYS})
        assert await ledger.readings(KEYS) == {KEYS[0]: (0, 1), KEYS[1]: (0, 6), KEYS[2]: (0, 1), KEYS[3]: (0, 1)}
    finally:
        await client.aclose()
