-- Admission's decisions without a transaction block: budgetgate_begin_decisions is
-- budgetgate_begin_batch with the ledger lock (shared) and the runs' locks taken at session
-- level, so they outlive this statement; every statement of the batch then commits on its own and
-- its one write (record_decisions) commits the batch, in one round trip instead of BEGIN, the
-- write and COMMIT. The caller lets the locks go (pg_advisory_unlock_all) once that write has
-- committed, or ends its session. budgetgate_begin_batch stays for processes of the release
-- before, which take transaction-scoped locks, until they are all replaced; both kinds conflict.
-- Both take their locks (budgetgate_lock_batch) and then read (budgetgate_batch_reads, the reads
-- of 0033, each query with a fresh snapshot, after the locks were granted) with the same code.
CREATE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    IF p_session THEN
        PERFORM pg_advisory_lock_shared(7301, 0);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(7301, 0);
    END IF;
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock(7302, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock(7302, lock_key);
        END IF;
    END LOOP;
END
$$;

CREATE FUNCTION budgetgate_batch_reads(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               budgetgate_committed_ledger_seq(),
               GREATEST(COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0),
                        COALESCE((SELECT max(g.revision) FROM budget_grants g), 0))::bigint,
               NULL::timestamptz;
    RETURN QUERY
        SELECT k.run_id, k.decision_id, k.attempt, x.outcome, x.request, x.response, NULL::bigint, NULL::bigint, k.decided_at
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT y.run_id, y.decision_id, y.attempt, y.decided_at FROM decision_keys y
                            WHERE y.run_id = ids.id ORDER BY y.attempt DESC LIMIT 1) AS k
        LEFT JOIN LATERAL (SELECT d.outcome, d.request, d.response FROM decisions d
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at) AS x ON true
        ORDER BY k.run_id;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, false);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids);
END
$$;

CREATE FUNCTION budgetgate_begin_decisions(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, true);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids);
END
$$;
