-- 0010_metering_batches: metering-ingest judges the samples of one Kafka poll together.

-- Begins judging a batch of samples ($1 run ids, $2 sample ids, $3 observed_at; one entry per
-- sample) in one round trip: takes the lock of every run (in lock-key order, so batches with
-- runs in common wait for each other instead of deadlocking), then returns
--   'run':      per run metering knows, its latest observed_at and cumulative counters;
--   'decision': per run metering does not know yet that has a decision;
--   per sample (idx, 1-based) of a known run, its recorded neighbours, as metering_begin_sample.
-- VOLATILE, so the reads after the locks see everything committed before they were granted.
CREATE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[])
RETURNS TABLE (idx integer, role text, run_id text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    RETURN QUERY
        SELECT NULL::integer, 'run', r.run_id, NULL::text, r.latest_observed_at, r.gpu_milli_hours_cumulative, r.node_milli_hours_cumulative
        FROM usage_runs r WHERE r.run_id = ANY (p_run_ids);
    RETURN QUERY
        SELECT NULL::integer, 'decision', x.id, NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint
        FROM (SELECT DISTINCT i.id FROM unnest(p_run_ids) AS i(id)) AS x
        WHERE NOT EXISTS (SELECT 1 FROM usage_runs r WHERE r.run_id = x.id)
          AND EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = x.id);
    RETURN QUERY
        WITH s AS (
            SELECT x.rid, x.sid, x.at, x.i FROM unnest(p_run_ids, p_sample_ids, p_observed_at) WITH ORDINALITY AS x(rid, sid, at, i)
        ), latest AS (
            -- The latest recorded sample of each run: one index probe per run.
            SELECT l.run_id, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours
            FROM (SELECT DISTINCT y.rid FROM s AS y) AS k
            CROSS JOIN LATERAL (SELECT u.run_id, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
                                FROM usage_records u WHERE u.run_id = k.rid ORDER BY u.observed_at DESC LIMIT 1) AS l
        )
        SELECT s.i::integer, 'same_id', s.rid, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
        FROM s JOIN usage_records u ON u.run_id = s.rid AND u.sample_id = s.sid
        UNION ALL
        -- The usual case, a sample after everything recorded: its neighbour before is the latest.
        SELECT s.i::integer, 'before', s.rid, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours
        FROM s JOIN latest l ON l.run_id = s.rid WHERE s.at > l.observed_at
        UNION ALL
        -- A late sample: its neighbours at, before and after its observed_at.
        SELECT s.i::integer, n.role, s.rid, n.sid, n.at, n.gpu, n.node
        FROM s JOIN latest l ON l.run_id = s.rid AND s.at <= l.observed_at
        CROSS JOIN LATERAL (
            (SELECT 'same_time' AS role, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at = s.at)
            UNION ALL
            (SELECT 'before', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at < s.at ORDER BY u.observed_at DESC LIMIT 1)
            UNION ALL
            (SELECT 'after', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at > s.at ORDER BY u.observed_at LIMIT 1)
        ) AS n;
END
$$;
