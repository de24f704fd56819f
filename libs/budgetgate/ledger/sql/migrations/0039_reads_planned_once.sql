-- 0039: what admission reads before each decision, planned once per session instead of on every
-- call. pg_stat_statements over 20 s of the 200/s open loop (one decision a batch) showed
-- budgetgate_begin_decisions at 700 µs a call, almost all of it planning:
--   - budgetgate_committed_ledger_seq was a SQL function that cannot be inlined (its body holds
--     subqueries), so Postgres planned its body anew on every call (140 µs, for a 10 µs read);
--     as PL/pgSQL its plan is kept for the session;
--   - the second query of budgetgate_batch_reads (each run's latest decision, from its month's
--     partition) took a custom plan on 70 % of calls: a generic plan of a query over a
--     partitioned table is costed as if it read every partition, though it prunes them when it
--     runs, so the plan cache judged it dearer. Planned for the parameters each time (220 µs),
--     it ran in 20 µs. Its generic plan is now always used. Forced so, the query as it was
--     hashed the whole of decisions on each call whenever that plan was made on empty tables
--     (as every connection of a new deployment makes it): the planner pulled the decision's
--     subquery up into a join. (Left to choose, the plan cache had taken custom plans there.)
--     The decision is now read by a LIMIT 1 subquery, which stays apart, so every plan probes
--     decision_keys' index per run and the partition of each decision's key, pruning the others
--     as it runs (tests/integration/test_batch_plans.py, whose count of scans had missed the
--     partitions).
CREATE OR REPLACE FUNCTION budgetgate_committed_ledger_seq() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN GREATEST(COALESCE((SELECT max(k.ledger_seq) FROM decision_keys k WHERE k.ledger_seq IS NOT NULL), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m), 0))::bigint;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_batch_reads(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
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
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at LIMIT 1) AS x ON true
        ORDER BY k.run_id;
END
$$;
