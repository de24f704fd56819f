-- 0044: a ledger lock per shard of the Redis ledger (budgetgate.core.shards): advisory lock
-- (7301, shard), taken shared by whatever changes a shard's reservations and exclusively by that
-- shard's rebuild and drift repair, so a shard is rebuilt while the others decide on. One shard
-- (the default) is shard 0: the lock every release before took. A batch of admission decisions
-- may span shards (one reserve script per shard, each decision on one): it takes the lock of
-- every shard it touches, in shard order, and reads each one's committed ledger sequence (0043),
-- a first row per shard. The functions of one argument stay for processes of the release before.
CREATE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean, p_shards integer[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    FOR lock_key IN SELECT DISTINCT s FROM unnest(p_shards) AS s ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock_shared(7301, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock_shared(7301, lock_key);
        END IF;
    END LOOP;
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock(7302, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock(7302, lock_key);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, p_session, ARRAY[0]);
END
$$;

CREATE FUNCTION budgetgate_batch_reads(p_run_ids text[], p_shards integer[], p_count integer)
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz, shard integer)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    revision bigint := GREATEST(COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0),
                                COALESCE((SELECT max(g.revision) FROM budget_grants g), 0));
BEGIN
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               CASE WHEN p_count = 1 THEN budgetgate_committed_ledger_seq() ELSE budgetgate_committed_ledger_seq(s, p_count) END,
               revision, NULL::timestamptz, s
        FROM (SELECT DISTINCT s FROM unnest(p_shards) AS s) AS shards(s) ORDER BY s;
    RETURN QUERY
        SELECT k.run_id, k.decision_id, k.attempt, x.outcome, x.request, x.response, NULL::bigint, NULL::bigint, k.decided_at, NULL::integer
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT y.run_id, y.decision_id, y.attempt, y.decided_at FROM decision_keys y
                            WHERE y.run_id = ids.id ORDER BY y.attempt DESC LIMIT 1) AS k
        LEFT JOIN LATERAL (SELECT d.outcome, d.request, d.response FROM decisions d
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at LIMIT 1) AS x ON true
        ORDER BY k.run_id;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_batch_reads(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT r.run_id, r.decision_id, r.attempt, r.outcome, r.request, r.response, r.committed_seq, r.override_revision, r.decided_at
                 FROM budgetgate_batch_reads(p_run_ids, ARRAY[0], 1) AS r;
END
$$;

CREATE FUNCTION budgetgate_begin_decisions(p_run_ids text[], p_shards integer[], p_count integer)
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz, shard integer)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, true, p_shards);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids, p_shards, p_count);
END
$$;
