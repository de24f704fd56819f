-- 0007_admission_fast_path: one round trip to begin a decision, and no foreign key from
-- reservations to ledger_entries (every reservation insert took a KEY SHARE lock on its ledger
-- row, which on a hot budget makes every concurrent decision share one row lock).

-- Takes the ledger lock (shared) and the run's lock, then reads the run's latest decision.
-- VOLATILE on purpose: in READ COMMITTED each query of a volatile function takes a fresh
-- snapshot, so the read sees every decision committed before the run's lock was granted.
CREATE FUNCTION budgetgate_begin_decision(p_run_id text)
RETURNS TABLE (decision_id uuid, attempt integer, outcome text, response jsonb)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7301, 0);
    PERFORM pg_advisory_xact_lock(7302, hashtext(p_run_id));
    RETURN QUERY
        SELECT d.decision_id, d.attempt, d.outcome, d.response
        FROM decisions d WHERE d.run_id = p_run_id ORDER BY d.attempt DESC LIMIT 1;
END
$$;

ALTER TABLE reservations DROP CONSTRAINT reservations_ledger_key_fkey;
