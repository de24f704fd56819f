-- 0029_metering_usage_bound: a metering sample above what its run can physically have used is
-- dead-lettered (impossible_usage), never charged: a run starts after its decision, so by
-- observed_at it used at most its GPUs (nodes) x (observed_at - its earliest decided_at), plus
-- the tolerance (BUDGETGATE_METERING_USAGE_TOLERANCE, and the clock slack
-- BUDGETGATE_MAX_FUTURE_SKEW_SECONDS). usage_runs keeps the run's capacity, filled when the run
-- is introduced, so the set-based path compares each sample with columns of its run's row.

-- The most GPUs and nodes any decision of the run (any attempt, any outcome) asked for (NULL:
-- some decision names no count, that counter has no bound) and its earliest decided_at. The
-- core raises them when a later decision asks for more (a run readmitted on more GPUs).
ALTER TABLE usage_runs
    ADD COLUMN max_gpus         integer,
    ADD COLUMN max_nodes        integer,
    ADD COLUMN first_decided_at timestamptz;

-- The capacity of each run of $1 that has a decision, as its decisions say: one index range a run.
CREATE FUNCTION metering_capacity(p_run_ids text[])
RETURNS TABLE (run_id text, max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT d.run_id,
           CASE WHEN count(d.gpus) = count(*) THEN max(d.gpus) END,
           CASE WHEN count(d.nodes) = count(*) THEN max(d.nodes) END,
           min(d.decided_at)
    FROM decisions d WHERE d.run_id = ANY (p_run_ids) GROUP BY d.run_id
$$;

UPDATE usage_runs r SET max_gpus = c.max_gpus, max_nodes = c.max_nodes, first_decided_at = c.first_decided_at
FROM metering_capacity(ARRAY(SELECT u.run_id FROM usage_runs u)) AS c WHERE r.run_id = c.run_id;

-- The run row of metering_begin_sample and metering_begin_batch carries the run's capacity.
DROP FUNCTION metering_begin_sample(text, text, timestamptz);
CREATE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(7310, hashtext(p_run_id));
    RETURN QUERY
        SELECT 'run', NULL::text, r.latest_observed_at, r.gpu_milli_hours_cumulative, r.node_milli_hours_cumulative,
               r.max_gpus, r.max_nodes, r.first_decided_at
        FROM usage_runs r WHERE r.run_id = p_run_id;
    IF NOT FOUND THEN
        RETURN QUERY
            SELECT 'decision', NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz
            WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p_run_id);
        RETURN;
    END IF;
    RETURN QUERY
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.sample_id = p_sample_id)
        UNION ALL
        (SELECT 'same_time', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at = p_observed_at)
        UNION ALL
        (SELECT 'before', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at < p_observed_at
         ORDER BY u.observed_at DESC LIMIT 1)
        UNION ALL
        (SELECT 'after', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at > p_observed_at
         ORDER BY u.observed_at LIMIT 1);
END
$$;
ALTER FUNCTION metering_begin_sample(text, text, timestamptz) SET plan_cache_mode = force_custom_plan;

DROP FUNCTION metering_begin_batch(text[], text[], timestamptz[]);
CREATE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[])
RETURNS TABLE (idx integer, role text, run_id text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    RETURN QUERY
        SELECT NULL::integer, 'run', r.run_id, NULL::text, r.latest_observed_at, r.gpu_milli_hours_cumulative, r.node_milli_hours_cumulative,
               r.max_gpus, r.max_nodes, r.first_decided_at
        FROM usage_runs r WHERE r.run_id = ANY (p_run_ids);
    RETURN QUERY
        SELECT NULL::integer, 'decision', x.id, NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz
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
        SELECT s.i::integer, 'same_id', s.rid, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN usage_records u ON u.run_id = s.rid AND u.sample_id = s.sid
        UNION ALL
        -- The usual case, a sample after everything recorded: its neighbour before is the latest.
        SELECT s.i::integer, 'before', s.rid, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN latest l ON l.run_id = s.rid WHERE s.at > l.observed_at
        UNION ALL
        -- A late sample: its neighbours at, before and after its observed_at.
        SELECT s.i::integer, n.role, s.rid, n.sid, n.at, n.gpu, n.node, NULL::integer, NULL::integer, NULL::timestamptz
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
ALTER FUNCTION metering_begin_batch(text[], text[], timestamptz[]) SET plan_cache_mode = force_custom_plan;

-- metering_place_batch takes the tolerance ($9 parts per million, $10 the clock slack in
-- microseconds), fills the capacity of the runs it introduces, and leaves to the core every run
-- with a sample above its bound.
DROP FUNCTION metering_place_batch(text[], text[], timestamptz[], bigint[], bigint[], text[], text[], text[]);
CREATE FUNCTION metering_place_batch(
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
               r.max_gpus, r.max_nodes, r.first_decided_at AS since
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
        -- index and read the run's whole history.
        LEFT JOIN LATERAL (SELECT u.run_id AS rid, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u WHERE u.event_id = s.event_id LIMIT 1) AS same_id ON true
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
            latest_observed_at = GREATEST(r.latest_observed_at, x.latest), updated_at = now()
        FROM (SELECT a.rid, max(a.cum_gpu) AS gpu, max(a.cum_node) AS node, count(*)::integer AS added, max(a.at) AS latest
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
