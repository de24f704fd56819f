-- 0043: a ledger generation per shard of the Redis ledger (budgetgate.core.shards). With several
-- shards, shard i's sequence hands out only numbers ≡ i (mod 64), so the highest number shard i
-- committed is the highest of its residue, in decision_keys and ledger_marks alike: read by an
-- index on the residue, one short backward scan per table. With one shard (the default) the
-- whole ledger is shard 0 of 1 and its committed sequence is the highest number, as before.
CREATE INDEX decision_keys_shard_seq ON decision_keys ((ledger_seq % 64), ledger_seq) WHERE ledger_seq IS NOT NULL;
CREATE INDEX ledger_marks_shard_seq ON ledger_marks ((ledger_seq % 64), ledger_seq);

CREATE FUNCTION budgetgate_committed_ledger_seq(p_shard integer, p_shards integer) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_shards = 1 THEN
        RETURN budgetgate_committed_ledger_seq();
    END IF;
    RETURN GREATEST(COALESCE((SELECT max(k.ledger_seq) FROM decision_keys k
                              WHERE k.ledger_seq IS NOT NULL AND k.ledger_seq % 64 = p_shard), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m WHERE m.ledger_seq % 64 = p_shard), 0))::bigint;
END
$$;
