-- 0034_partitioned_usage_records: usage records partitioned by the UTC month of observed_at, as
-- decisions are by decided_at (0033): a month older than the retention is archived with the
-- decisions of that month (`budgetgate ledger archive`), and a chargeback report of a month
-- reads that month's partition alone.
--
-- Uniqueness that does not hold the partition key is not enforced across partitions, so the
-- constraints now hold observed_at: a run's sample id is unique per observed_at (a resend, the
-- same sample at the same instant, still fails), its observed_at unique as before, an event id
-- unique per observed_at. A sample id sent again with another observed_at is a conflict metering
-- finds itself, under the run's lock, before it records anything (budgetgate.core.metering).
--
-- A run's usage_runs row now knows its earliest observed_at too (with latest_observed_at, the
-- months its records are in): metering_place_batch looks for a sample id only there, so a batch
-- reads the partitions of the months its runs ran in, not every month kept.
--
-- Every record is copied into the new table: a rewrite under ACCESS EXCLUSIVE, metering waits
-- (docs/operations.md, "Upgrades").
ALTER TABLE usage_records RENAME TO usage_records_0033;
ALTER TABLE usage_records_0033 DROP CONSTRAINT usage_records_pkey, DROP CONSTRAINT usage_records_run_id_observed_at_key,
    DROP CONSTRAINT usage_records_event_id_key;
DROP INDEX usage_records_observed;

CREATE TABLE usage_records (
    run_id                      text NOT NULL,
    sample_id                   text NOT NULL,
    observed_at                 timestamptz NOT NULL,
    gpu_milli_hours             bigint NOT NULL CONSTRAINT usage_records_gpu_milli_hours_check CHECK (gpu_milli_hours >= 0),
    node_milli_hours            bigint NOT NULL CONSTRAINT usage_records_node_milli_hours_check CHECK (node_milli_hours >= 0),
    gpu_milli_hours_cumulative  bigint NOT NULL CONSTRAINT usage_records_check CHECK (gpu_milli_hours_cumulative >= gpu_milli_hours),
    node_milli_hours_cumulative bigint NOT NULL CONSTRAINT usage_records_check1 CHECK (node_milli_hours_cumulative >= node_milli_hours),
    gpu_milli_hours_delta       bigint NOT NULL CONSTRAINT usage_records_gpu_milli_hours_delta_check CHECK (gpu_milli_hours_delta >= 0),
    node_milli_hours_delta      bigint NOT NULL CONSTRAINT usage_records_node_milli_hours_delta_check CHECK (node_milli_hours_delta >= 0),
    late                        boolean NOT NULL,
    exporter                    text NOT NULL,
    source                      text NOT NULL CONSTRAINT usage_records_source_check CHECK (source IN ('kafka', 'http')),
    event_id                    text NOT NULL,
    recorded_at                 timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT usage_records_pkey PRIMARY KEY (run_id, sample_id, observed_at),
    CONSTRAINT usage_records_run_id_observed_at_key UNIQUE (run_id, observed_at),
    CONSTRAINT usage_records_event_id_key UNIQUE (event_id, observed_at)
) PARTITION BY RANGE (observed_at);
CREATE INDEX usage_records_observed ON usage_records (observed_at) INCLUDE (run_id, gpu_milli_hours_delta, node_milli_hours_delta);
CREATE TABLE usage_records_default PARTITION OF usage_records DEFAULT;

SELECT budgetgate_ensure_month('usage_records', m.month)
FROM (SELECT DISTINCT date_trunc('month', observed_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month FROM usage_records_0033) AS m;
SELECT budgetgate_ensure_partitions('usage_records', 3);
INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                           node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id, recorded_at)
SELECT run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
       node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id, recorded_at
FROM usage_records_0033;
DROP TABLE usage_records_0033;

ALTER TABLE usage_runs ADD COLUMN earliest_observed_at timestamptz;
UPDATE usage_runs r SET earliest_observed_at = x.earliest
FROM (SELECT run_id, min(observed_at) AS earliest FROM usage_records GROUP BY run_id) AS x
WHERE r.run_id = x.run_id;

CREATE OR REPLACE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[], p_tolerance_ppm bigint, p_slack_us bigint
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    INSERT INTO usage_runs (run_id, max_gpus, max_nodes, first_decided_at)
    SELECT c.run_id, c.max_gpus, c.max_nodes, c.first_decided_at
    FROM metering_capacity(ARRAY(
        SELECT x.id FROM (SELECT DISTINCT i.id FROM unnest(p_run_ids) AS i(id)) AS x
        WHERE NOT EXISTS (SELECT 1 FROM usage_runs r WHERE r.run_id = x.id)
          AND NOT EXISTS (SELECT 1 FROM metering_pending p WHERE p.run_id = x.id))) AS c
    ON CONFLICT (run_id) DO NOTHING;
    RETURN QUERY
    WITH s AS (
        SELECT x.i::integer AS i, x.rid, x.sid, x.at, x.gpu, x.node, x.exporter, x.source, x.event_id
        FROM unnest(p_run_ids, p_sample_ids, p_observed_at, p_gpu, p_node, p_exporters, p_sources, p_event_ids)
             WITH ORDINALITY AS x(rid, sid, at, gpu, node, exporter, source, event_id, i)
    ), run AS (
        SELECT r.run_id AS rid, r.gpu_milli_hours_cumulative AS gpu, r.node_milli_hours_cumulative AS node, r.latest_observed_at AS latest,
               r.max_gpus, r.max_nodes, r.first_decided_at AS since, r.earliest_observed_at AS earliest
        FROM usage_runs r WHERE r.run_id IN (SELECT DISTINCT y.rid FROM s AS y)
    ), known AS (
        -- The samples of runs metering knows, each with the recorded sample of the same id and
        -- of the same time, and for one observed before the run's latest (late) the recorded
        -- samples either side of it; index probes only, whatever the run's history.
        SELECT s.i, s.rid, s.sid, s.at, s.gpu, s.node, run.gpu AS run_gpu, run.node AS run_node, run.latest,
               COALESCE(same_id.rid = s.rid AND same_id.sid = s.sid, false) AS has_id, same_id.at AS id_at, same_id.gpu AS id_gpu, same_id.node AS id_node,
               same_time.sid AS time_sid, same_time.gpu AS time_gpu, same_time.node AS time_node,
               before.gpu AS before_gpu, before.node AS before_node, after.gpu AS after_gpu, after.node AS after_node,
               -- Above what the run's GPUs (nodes) can have used since its earliest decision, with
               -- the tolerance (budgetgate.core.metering.UsageBound, the same exact arithmetic):
               -- left to the core, which rejects it (impossible_usage) or, the run's decisions
               -- asking for more by now, raises the capacity kept here.
               COALESCE(s.gpu::numeric * 1000000000 > run.max_gpus * span.us * (1000000 + p_tolerance_ppm)
                        OR s.node::numeric * 1000000000 > run.max_nodes * span.us * (1000000 + p_tolerance_ppm), false) AS over
        FROM s JOIN run USING (rid)
        -- No earliest decision (a run whose decisions are gone): no bound, as in the core.
        CROSS JOIN LATERAL (SELECT CASE WHEN run.since IS NOT NULL
                                        THEN GREATEST((extract(epoch FROM s.at) - extract(epoch FROM run.since)) * 1000000 + p_slack_us, 0) END AS us) AS span
        -- The same sample id, found by the event id of its usage record (derived from run and
        -- sample id): with run_id in the condition the planner may take the (run_id, observed_at)
        -- index and read the run's whole history. 0034: within the months the run has records
        -- in (its earliest and latest observed_at), so only their partitions are read.
        LEFT JOIN LATERAL (SELECT u.run_id AS rid, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u
                           WHERE u.event_id = s.event_id AND u.observed_at >= COALESCE(run.earliest, '-infinity')
                             AND u.observed_at <= COALESCE(run.latest, 'infinity')
                           LIMIT 1) AS same_id ON true
        LEFT JOIN LATERAL (SELECT u.sample_id AS sid, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at = s.at AND s.at <= run.latest LIMIT 1) AS same_time ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node FROM usage_records u
                           WHERE u.run_id = s.rid AND u.observed_at < s.at AND s.at < run.latest
                           ORDER BY u.observed_at DESC LIMIT 1) AS before ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node FROM usage_records u
                           WHERE u.run_id = s.rid AND u.observed_at > s.at AND s.at < run.latest
                           ORDER BY u.observed_at LIMIT 1) AS after ON true
    ), by_time AS (
        -- In time order per run: the sample before each (the first of an observed_at has
        -- another time before it), and the first sample of each observed_at.
        SELECT k.*, lag(k.at) OVER t AS prev_at, lag(k.gpu) OVER t AS prev_gpu, lag(k.node) OVER t AS prev_node,
               first_value(k.sid) OVER (PARTITION BY k.rid, k.at ORDER BY k.i) AS first_sid
        FROM known k WINDOW t AS (PARTITION BY k.rid ORDER BY k.at, k.i)
    ), odd AS (
        -- Runs with a sample the set-based judgement does not cover: one above the run's bound, a
        -- conflict (same id or same time with other values, in the batch or recorded), or counters
        -- that go down.
        SELECT b.rid FROM by_time b
        WHERE b.over
           OR (b.has_id AND (b.id_at, b.id_gpu, b.id_node) IS DISTINCT FROM (b.at, b.gpu, b.node))
           OR (b.time_sid IS NOT NULL AND (b.time_gpu, b.time_node) IS DISTINCT FROM (b.gpu, b.node))
           OR b.gpu < b.prev_gpu OR b.node < b.prev_node
           OR (b.prev_at = b.at AND (b.prev_gpu <> b.gpu OR b.prev_node <> b.node))
           OR ((b.latest IS NULL OR b.at > b.latest) AND (b.gpu < b.run_gpu OR b.node < b.run_node))
           OR b.gpu < b.before_gpu OR b.node < b.before_node OR b.after_gpu < b.gpu OR b.after_node < b.node
        UNION
        SELECT k.rid FROM known k GROUP BY k.rid, k.sid
        HAVING min(k.at) <> max(k.at) OR min(k.gpu) <> max(k.gpu) OR min(k.node) <> max(k.node)
    ), clean AS (
        SELECT b.*, b.time_sid IS NULL AND b.prev_at IS DISTINCT FROM b.at AS accepted
        FROM by_time b WHERE b.rid NOT IN (SELECT o.rid FROM odd o)
    ), accepted AS (
        -- In batch order per run: the run's high-water mark before and after each accepted sample.
        SELECT c.i, c.rid, c.sid, c.at, c.gpu, c.node,
               GREATEST(c.run_gpu, max(c.gpu) OVER upto) AS cum_gpu, GREATEST(c.run_node, max(c.node) OVER upto) AS cum_node,
               GREATEST(c.run_gpu, max(c.gpu) OVER earlier) AS was_gpu, GREATEST(c.run_node, max(c.node) OVER earlier) AS was_node,
               COALESCE(c.at < GREATEST(c.latest, max(c.at) OVER earlier), false) AS is_late
        FROM clean c WHERE c.accepted
        WINDOW upto AS (PARTITION BY c.rid ORDER BY c.i),
               earlier AS (PARTITION BY c.rid ORDER BY c.i ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    ), recorded AS (
        INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                                   node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id)
        SELECT a.rid, a.sid, a.at, a.gpu, a.node, a.cum_gpu, a.cum_node, a.cum_gpu - a.was_gpu, a.cum_node - a.was_node, a.is_late,
               s.exporter, s.source, s.event_id
        FROM accepted a JOIN s USING (i)
    ), raised AS (
        UPDATE usage_runs r
        SET gpu_milli_hours_cumulative = x.gpu, node_milli_hours_cumulative = x.node, samples = r.samples + x.added,
            latest_observed_at = GREATEST(r.latest_observed_at, x.latest), earliest_observed_at = LEAST(r.earliest_observed_at, x.earliest),
            updated_at = now()
        FROM (SELECT a.rid, max(a.cum_gpu) AS gpu, max(a.cum_node) AS node, count(*)::integer AS added, max(a.at) AS latest, min(a.at) AS earliest
              FROM accepted a GROUP BY a.rid) AS x
        WHERE r.run_id = x.rid
    )
    SELECT a.i, 'accepted', NULL::text, a.cum_gpu, a.cum_node, a.cum_gpu - a.was_gpu, a.cum_node - a.was_node, a.is_late FROM accepted a
    UNION ALL
    -- A duplicate of the recorded sample of its id, or of the first sample of its observed_at,
    -- recorded or accepted earlier in the batch.
    SELECT c.i, 'duplicate', CASE WHEN c.has_id THEN c.sid ELSE COALESCE(c.time_sid, c.first_sid) END,
           NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean
    FROM clean c WHERE NOT c.accepted
    UNION ALL
    SELECT s.i, 'python', NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean
    FROM s WHERE s.i NOT IN (SELECT c.i FROM clean c);
END
$$;
ALTER FUNCTION metering_place_batch(text[], text[], timestamptz[], bigint[], bigint[], text[], text[], text[], bigint, bigint)
    SET plan_cache_mode = force_custom_plan;
