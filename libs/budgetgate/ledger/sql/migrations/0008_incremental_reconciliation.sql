-- 0008_incremental_reconciliation: the reconciler folds each new fact into a run's running state
-- instead of reloading the run's whole history (budgetgate.core.run_state).

-- Each folded sample keeps the high-water marks of the run's counters through it, in
-- (observed_at, sample_id) order; NULL until the reconciler has folded it. Rows that existed
-- before this migration are folded (once, whole run) the first time their run is settled.
ALTER TABLE run_samples ADD COLUMN gpu_high bigint, ADD COLUMN node_high bigint;
CREATE INDEX run_samples_line ON run_samples (run_id, observed_at, sample_id COLLATE "C") WHERE gpu_high IS NOT NULL;
CREATE INDEX run_samples_unfolded ON run_samples (run_id) WHERE gpu_high IS NULL;

-- A run's metered side as folded so far; no row: fold the whole run on its next settlement.
CREATE TABLE run_meters (
    run_id    text PRIMARY KEY,
    gpu       bigint NOT NULL,                 -- metered totals (the high-water marks)
    node      bigint NOT NULL,
    covered   timestamptz,                     -- the latest sample time
    last_at   timestamptz,                     -- the last sample on the line, (observed_at, sample_id)
    last_id   text,
    used      jsonb NOT NULL DEFAULT '{}',     -- metered usage per policy id, in its unit
    timed     jsonb NOT NULL DEFAULT '[]'      -- charges from time alone as last settled: [[key, bucket, amount]]
);

-- Settlements that failed for a reason other than an outage (an amount out of range, a rule
-- violated): retried a bounded number of times, then dead-lettered with the reason.
CREATE TABLE settlement_failures (
    run_id          text PRIMARY KEY,
    attempts        integer NOT NULL DEFAULT 1,
    reason          text NOT NULL,
    dead            boolean NOT NULL DEFAULT false,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now()
);
