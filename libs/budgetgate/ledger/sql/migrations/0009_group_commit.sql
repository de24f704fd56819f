-- 0009_group_commit: decisions are begun and recorded a batch at a time; every reserving
-- decision records the ledger sequence Redis gave it, so Redis can prove it is current; and the
-- run's resources are typed columns, read by the reconciler instead of the stored request.

ALTER TABLE decisions
    ADD COLUMN ledger_seq bigint,      -- Redis's ledger sequence after this decision reserved
    ADD COLUMN gpus       integer,
    ADD COLUMN nodes      integer,
    ADD COLUMN flavor     text,
    ADD COLUMN region     text;
UPDATE decisions SET gpus = (request -> 'resources' ->> 'gpus')::integer,
                     nodes = COALESCE((request -> 'resources' ->> 'nodes')::integer, 1),
                     flavor = request -> 'resources' ->> 'flavor',
                     region = request -> 'resources' ->> 'region';
CREATE INDEX decisions_ledger_seq ON decisions (ledger_seq) WHERE ledger_seq IS NOT NULL;

DROP FUNCTION budgetgate_begin_decision(text);

-- Takes the ledger lock (shared) and the lock of every run of a batch (in one order, so two
-- batches never wait on each other in a cycle), then reads: first a row with only the highest
-- ledger sequence Postgres committed, then the latest decision of each run that has one.
-- VOLATILE on purpose: each query takes a fresh snapshot after the locks were granted.
CREATE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint)
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
               COALESCE((SELECT max(d.ledger_seq) FROM decisions d WHERE d.ledger_seq IS NOT NULL), 0)::bigint;
    RETURN QUERY
        SELECT DISTINCT ON (d.run_id) d.run_id, d.decision_id, d.attempt, d.outcome, d.request, d.response,
               NULL::bigint
        FROM decisions d WHERE d.run_id = ANY(p_run_ids) ORDER BY d.run_id, d.attempt DESC;
END
$$;
