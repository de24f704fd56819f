-- 0025_ledger_marks: Redis's ledger sequence is advanced by every write that tightens the ledger,
-- not by reserving decisions alone. A settlement's increases (usage beyond a reservation), a
-- late start's quota holds and a pool token's grant or renewal each take the next number from
-- Redis and record it here, in the transaction that commits them. Admission decides only on a
-- Redis whose number is not behind the highest either table holds: a Redis restored from a
-- snapshot taken before such a write (or a lagging replica) is otherwise current by the
-- decisions alone, and decides on room that usage has taken (invariant 8). The table keeps the
-- highest number; the reconciler prunes the others. The number is unique, so a Redis that hands
-- one out twice fails the second commit, and its transaction's failure rebuilds Redis.
CREATE TABLE ledger_marks (
    ledger_seq  bigint PRIMARY KEY,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION budgetgate_committed_ledger_seq() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT GREATEST(COALESCE((SELECT max(d.ledger_seq) FROM decisions d WHERE d.ledger_seq IS NOT NULL), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m), 0))::bigint
$$;

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
               budgetgate_committed_ledger_seq(),
               COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0)::bigint;
    RETURN QUERY
        SELECT d.run_id, d.decision_id, d.attempt, d.outcome, d.request, d.response, NULL::bigint, NULL::bigint
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT x.run_id, x.decision_id, x.attempt, x.outcome, x.request, x.response FROM decisions x
                            WHERE x.run_id = ids.id ORDER BY x.attempt DESC LIMIT 1) AS d
        ORDER BY d.run_id;
END
$$;
