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
