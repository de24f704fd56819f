-- 0004_reconciler: the facts the reconciler settles runs from (lifecycle events, usage samples),
-- what each run is charged on each ledger key, and the hold and alert state of budgets.
-- No foreign keys to ledger_entries: a KEY SHARE lock on a hot ledger row per insert would
-- queue behind every concurrent change to that row.

-- Lifecycle events as the platform reported them; the event id deduplicates resends.
CREATE TABLE lifecycle_events (
    event_id   text PRIMARY KEY,
    run_id     text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('STARTED', 'COMPLETED', 'FAILED', 'CANCELLED', 'EVICTED', 'READMITTED')),
    event_time timestamptz NOT NULL,
    gpus       integer NOT NULL DEFAULT 0 CHECK (gpus >= 0),
    nodes      integer NOT NULL DEFAULT 0 CHECK (nodes >= 0),
    flavor     text,
    reason     text,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lifecycle_events_run ON lifecycle_events (run_id);

-- Usage samples from usage.records.v1: the run's cumulative counters as of observed_at
-- (milli-unit-seconds); the exporter's sample id deduplicates resends.
CREATE TABLE run_samples (
    run_id      text NOT NULL,
    sample_id   text NOT NULL,
    observed_at timestamptz NOT NULL,
    gpu         bigint NOT NULL CHECK (gpu >= 0),
    node        bigint NOT NULL CHECK (node >= 0),
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sample_id)
);

-- Runs with new facts, waiting to be settled; claimed with FOR UPDATE SKIP LOCKED.
CREATE TABLE runs_to_settle (
    run_id text PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT now()
);

-- Where each run stands, as last settled. review_at: when time alone changes its charges next.
CREATE TABLE run_settlements (
    run_id        text PRIMARY KEY,
    decision_id   uuid NOT NULL REFERENCES decisions (decision_id),
    phase         text NOT NULL CHECK (phase IN ('admitted', 'running', 'evicted', 'ended')),
    final         boolean NOT NULL DEFAULT false,
    provisional   boolean NOT NULL DEFAULT false,
    released      boolean NOT NULL DEFAULT false,  -- the reservation was given back unused
    over_running  boolean NOT NULL DEFAULT false,
    final_state   text,
    ended_at      timestamptz,
    wall          bigint NOT NULL DEFAULT 0,       -- wall milli-hours across all admissions
    projected_gpu bigint NOT NULL,
    actual_gpu    bigint NOT NULL DEFAULT 0,
    error_gpu     bigint NOT NULL DEFAULT 0,       -- actual - projected
    review_at     timestamptz,
    revision      integer NOT NULL DEFAULT 0,
    settled_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_settlements_review ON run_settlements (review_at) WHERE review_at IS NOT NULL;

-- What a run has consumed on a ledger key: per hour bucket on rolling windows (so usage can age
-- out), in one bucket (1970-01-01) on calendar windows.
CREATE TABLE run_charges (
    run_id     text NOT NULL,
    ledger_key text NOT NULL,
    bucket     timestamptz NOT NULL,
    amount     bigint NOT NULL CHECK (amount > 0),
    PRIMARY KEY (run_id, ledger_key, bucket)
);
CREATE INDEX run_charges_key ON run_charges (ledger_key, bucket);

-- How far usage has aged out of each rolling-window ledger key: buckets before aged_through
-- no longer count in its consumed.
CREATE TABLE rolling_ages (
    ledger_key   text PRIMARY KEY,
    rolling_days integer NOT NULL CHECK (rolling_days >= 1),
    aged_through timestamptz NOT NULL
);

-- Budgets on hold (on_exhausted hold / hold-and-drain, consumed >= limit); the row goes when
-- the hold is lifted.
CREATE TABLE budget_holds (
    ledger_key   text PRIMARY KEY,
    policy_id    text NOT NULL,
    scope_id     text NOT NULL,
    on_exhausted text NOT NULL CHECK (on_exhausted IN ('hold', 'hold-and-drain')),
    held_at      timestamptz NOT NULL DEFAULT now()
);

-- Threshold alerts sent, once per ledger key (window) and threshold.
CREATE TABLE budget_alerts (
    ledger_key        text NOT NULL,
    threshold_percent integer NOT NULL CHECK (threshold_percent > 0),
    alerted_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ledger_key, threshold_percent)
);
