-- 0028_provisional_holds: a run the Kubernetes validating webhook admitted holds provisionally,
-- since the API server may still refuse its object after the webhook answered (a later webhook,
-- a ResourceQuota, a name already taken). Admission writes the row with the decision; the
-- reconciler deletes it when a fact confirms the object (STORED from the lifecycle controller, any
-- start, eviction or end, a usage sample), or when it gives the hold back after
-- BUDGETGATE_PROVISIONAL_HOLD_SECONDS ("the object was never stored"), or the run ends. The rows
-- are the provisional holds still open, so the reconciler's walk over them stays short.
ALTER TABLE lifecycle_events
    DROP CONSTRAINT lifecycle_events_kind_check,
    ADD CONSTRAINT lifecycle_events_kind_check
        CHECK (kind IN ('STARTED', 'COMPLETED', 'FAILED', 'CANCELLED', 'EVICTED', 'READMITTED', 'STORED'));

CREATE TABLE provisional_holds (
    run_id      text PRIMARY KEY,
    decision_id uuid NOT NULL,
    held_since  timestamptz NOT NULL
);
CREATE INDEX provisional_holds_held_since ON provisional_holds (held_since);
