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
-- much it raised that (0 for a late sample, observed before the run's latest). Every row is
-- also a usage.records.v1 message with the same event_id.
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

-- Begins judging a sample in one round trip: takes the run's lock, then returns the run's state
-- (role 'run': latest observed_at and the cumulative counters) and the recorded samples the new
-- one is compared with ('same_id', 'same_time', 'before', 'after'); for a run metering does not
-- know yet, only whether it has a decision (role 'decision'). VOLATILE on purpose: in READ
-- COMMITTED each query of a volatile function takes a fresh snapshot, so the reads see
-- everything committed before the lock was granted.
CREATE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7310, hashtext(p_run_id));
    RETURN QUERY
        SELECT 'run', NULL::text, r.latest_observed_at, r.gpu_milli_hours_cumulative, r.node_milli_hours_cumulative
        FROM usage_runs r WHERE r.run_id = p_run_id;
    IF NOT FOUND THEN
        RETURN QUERY
            SELECT 'decision', NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint
            WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p_run_id);
        RETURN;
    END IF;
    RETURN QUERY
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
         FROM usage_records u WHERE u.run_id = p_run_id AND u.sample_id = p_sample_id)
        UNION ALL
        (SELECT 'same_time', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at = p_observed_at)
        UNION ALL
        (SELECT 'before', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at < p_observed_at
         ORDER BY u.observed_at DESC LIMIT 1)
        UNION ALL
        (SELECT 'after', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at > p_observed_at
         ORDER BY u.observed_at LIMIT 1);
END
$$;
