-- The whole current schema in one file, for reading and for the drift test: a database built
-- from it must equal one built from the numbered migrations. Update it with every migration.
-- Amounts are bigint in fixed-point units (milli-unit-seconds; micro-currency for cost).

CREATE TABLE policy_bundles (
    git_sha     text PRIMARY KEY,
    documents   jsonb NOT NULL,
    source      text NOT NULL,
    applied_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The active bundle is the latest activation; re-applying an older SHA activates it again.
CREATE TABLE policy_activations (
    seq          bigserial PRIMARY KEY,
    git_sha      text NOT NULL REFERENCES policy_bundles (git_sha),
    activated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE ledger_entries (
    ledger_key     text PRIMARY KEY,
    scope_id       text NOT NULL,
    unit           text NOT NULL CHECK (unit IN ('gpu_hours', 'node_hours', 'wall_hours', 'cost')),
    window_key     text NOT NULL,
    window_start   timestamptz,          -- NULL for rolling windows
    window_end     timestamptz,
    policy_id      text NOT NULL,
    policy_git_sha text NOT NULL,
    limit_amount   bigint NOT NULL CHECK (limit_amount >= 0),
    consumed       bigint NOT NULL DEFAULT 0 CHECK (consumed >= 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_entries_scope ON ledger_entries (scope_id, window_start);
CREATE INDEX ledger_entries_policy ON ledger_entries (policy_id);

CREATE TABLE decisions (
    decision_id       uuid PRIMARY KEY,
    run_id            text NOT NULL,
    attempt           integer NOT NULL CHECK (attempt >= 1),
    outcome           text NOT NULL CHECK (outcome IN ('ALLOW', 'DENY', 'DELAY')),
    reason            text NOT NULL,
    namespace         text NOT NULL,
    labels            jsonb NOT NULL,
    job_namespace     text,
    job_name          text,
    policy_bundle_sha text,
    projected_gpu     bigint NOT NULL,
    showback_micros   bigint,
    currency          text,
    request           jsonb NOT NULL,
    response          jsonb NOT NULL,   -- the answer as first given; replays return it
    decided_at        timestamptz NOT NULL,
    UNIQUE (run_id, attempt)
);
CREATE INDEX decisions_decided_at ON decisions (decided_at);

CREATE TABLE decision_evaluations (
    decision_id        uuid NOT NULL REFERENCES decisions (decision_id),
    policy_id          text NOT NULL,
    policy_git_sha     text NOT NULL,
    scope_id           text NOT NULL,
    ledger_key         text,             -- NULL when a label violation denied before any ledger
    window_start       timestamptz,
    window_end         timestamptz,
    unit               text NOT NULL,
    enforcement        text NOT NULL,
    outcome            text NOT NULL,
    limit_amount       bigint NOT NULL,
    projected          bigint NOT NULL,
    remaining          bigint,
    admitted           bigint NOT NULL,
    deficit            bigint,
    next_eligible_time timestamptz,
    PRIMARY KEY (decision_id, policy_id)
);
CREATE INDEX decision_evaluations_scope ON decision_evaluations (scope_id, window_start);

CREATE TABLE reservations (
    run_id         text NOT NULL,
    ledger_key     text NOT NULL REFERENCES ledger_entries (ledger_key),
    decision_id    uuid NOT NULL REFERENCES decisions (decision_id),
    amount         bigint NOT NULL CHECK (amount >= 0),
    state          text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released', 'reconciled')),
    expected_end   timestamptz NOT NULL,  -- submission time + projected runtime
    created_at     timestamptz NOT NULL DEFAULT now(),
    ended_at       timestamptz,
    end_reason     text,
    PRIMARY KEY (run_id, ledger_key)
);
CREATE INDEX reservations_held ON reservations (ledger_key, expected_end) WHERE state = 'held';

-- Transactional outbox: written with the decision, published to Kafka by a relay.
CREATE TABLE outbox (
    id           bigserial PRIMARY KEY,
    topic        text NOT NULL,           -- logical topic name, without any deployment prefix
    key          text,
    payload      bytea NOT NULL,
    headers      jsonb NOT NULL DEFAULT '[]',
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;

-- 0002_inbox: the inbox of every Kafka consumer: an event id is processed at most once per
-- consumer, recorded in the same transaction as its effect.
CREATE TABLE inbox (
    consumer     text NOT NULL,
    event_id     text NOT NULL,
    topic        text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- 0003_metering: usage normalized from metering samples (metering-ingest), deduplicated.
-- Amounts are milli-unit-seconds (GPU-seconds x 1000; one GPU-hour = 3,600,000).

-- One row per run with usage: its high-water mark (the largest counters of any accepted sample,
-- which never go down). A row exists only for a run that has a decision.
CREATE TABLE usage_runs (
    run_id                     text PRIMARY KEY,
    gpu_milli_hours_cumulative  bigint NOT NULL DEFAULT 0 CHECK (gpu_milli_hours_cumulative >= 0),
    node_milli_hours_cumulative bigint NOT NULL DEFAULT 0 CHECK (node_milli_hours_cumulative >= 0),
    samples                    integer NOT NULL DEFAULT 0,
    latest_observed_at         timestamptz,
    updated_at                 timestamptz NOT NULL DEFAULT now()
);

-- One row per accepted sample. gpu/node_milli_hours are the sample's own counters (what the run
-- had used as of observed_at); *_cumulative is the run's high-water mark after it, *_delta how
-- much it raised that. A late sample (observed before the run's latest) has delta 0 and is not
-- published; every other row is also a usage.records.v1 message with the same event_id.
-- Ordered by observed_at, the counters of a run never go down.
CREATE TABLE usage_records (
    run_id                      text NOT NULL,
    sample_id                   text NOT NULL,
    observed_at                 timestamptz NOT NULL,
    gpu_milli_hours             bigint NOT NULL CHECK (gpu_milli_hours >= 0),
    node_milli_hours            bigint NOT NULL CHECK (node_milli_hours >= 0),
    gpu_milli_hours_cumulative  bigint NOT NULL CHECK (gpu_milli_hours_cumulative >= gpu_milli_hours),
    node_milli_hours_cumulative bigint NOT NULL CHECK (node_milli_hours_cumulative >= node_milli_hours),
    gpu_milli_hours_delta       bigint NOT NULL CHECK (gpu_milli_hours_delta >= 0),
    node_milli_hours_delta      bigint NOT NULL CHECK (node_milli_hours_delta >= 0),
    late                        boolean NOT NULL,
    exporter                    text NOT NULL,
    source                      text NOT NULL CHECK (source IN ('kafka', 'http')),
    event_id                    text NOT NULL UNIQUE,
    recorded_at                 timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sample_id),
    UNIQUE (run_id, observed_at)
);

-- Valid samples of runs without a decision yet, kept until one appears (then applied) or until
-- expires_at (observed_at + the grace period; then dead-lettered as unknown_run).
CREATE TABLE metering_pending (
    run_id          text NOT NULL,
    sample_id       text NOT NULL,
    observed_at     timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    source          text NOT NULL CHECK (source IN ('kafka', 'http')),
    topic           text NOT NULL,
    kafka_partition integer,
    kafka_offset    bigint,
    payload         bytea NOT NULL,
    -- JSON [[name, base64 value], ...]: bytea, because a header value may hold NUL bytes.
    headers         bytea NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sample_id)
);
CREATE INDEX metering_pending_expiry ON metering_pending (expires_at);

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
