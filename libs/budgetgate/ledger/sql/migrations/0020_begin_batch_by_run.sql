-- 0020_begin_batch_by_run: budgetgate_begin_batch finds each run's latest decision with one
-- index probe per run (LATERAL ... ORDER BY attempt DESC LIMIT 1) instead of DISTINCT ON over
-- `run_id = ANY(...)`. Its generic plan probes the (run_id, attempt) index even when it was made
-- on an empty table, so the function goes back to PL/pgSQL's cached plans: 0019's custom plan
-- per call cost about 155 us of planning per batch (a batch of 32 runs over 50,000 decisions:
-- 652 us a call planned each time, 496 us with a generic plan of the old query).
CREATE OR REPLACE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7301, 0);
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(7302, lock_key);
    END LOOP;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               COALESCE((SELECT max(d.ledger_seq) FROM decisions d WHERE d.ledger_seq IS NOT NULL), 0)::bigint,
               COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0)::bigint;
    RETURN QUERY
        SELECT d.run_id, d.decision_id, d.attempt, d.outcome, d.request, d.response, NULL::bigint, NULL::bigint
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT x.run_id, x.decision_id, x.attempt, x.outcome, x.request, x.response FROM decisions x
                            WHERE x.run_id = ids.id ORDER BY x.attempt DESC LIMIT 1) AS d
        ORDER BY d.run_id;
END
$$;
ALTER FUNCTION budgetgate_begin_batch(text[]) RESET plan_cache_mode;
