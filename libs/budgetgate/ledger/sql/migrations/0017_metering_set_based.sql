-- 0017_metering_set_based: metering-ingest judges and records a Kafka poll's samples in SQL, a
-- few statements per batch instead of Python per sample (issue 9).

-- Places a batch of valid samples ($1.. one array entry per sample, in batch order; event ids
-- are those of their usage records) in one round trip, under the locks of all their runs (taken
-- in lock-key order, as metering_begin_batch does). A run with a decision that metering does not
-- know yet and that has nothing pending is started here.
--
-- The samples of a "clean" run are judged here, set-based; every other sample comes back with
-- outcome 'python', for the core (budgetgate.core.metering.assess_batch) to judge: samples of a
-- run without a decision (kept pending), of a run with pending samples to apply first, and of a
-- run where any sample of the batch conflicts with another (same sample id, or same observed_at,
-- with other values, within the batch or against what is recorded) or would make the run's
-- counters go down. In a clean run every distinct point (observed_at, counters) that is not
-- recorded yet is accepted at its first occurrence in the batch and every other sample is a
-- duplicate, of the recorded sample or of that first occurrence, which is what assess gives
-- sample after sample (tests/integration/test_metering_set_based.py checks that it is).
-- The cumulative after an accepted sample is the running maximum of each counter, the delta
-- how much it rose, and a sample is late when observed before the latest recorded or accepted
-- earlier in the batch: as assess_batch. Accepted samples are recorded in usage_records and their
-- runs' high-water marks raised, in this statement.
--
-- Returns one row per sample (idx, 1-based): outcome 'accepted' (with cumulative, delta, late),
-- 'duplicate' (with of_sample) or 'python'.
-- VOLATILE, so the statements after the locks see everything committed before they were granted.
CREATE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[]
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    INSERT INTO usage_runs (run_id)
    SELECT x.id FROM (SELECT DISTINCT i.id FROM unnest(p_run_ids) AS i(id)) AS x
    WHERE NOT EXISTS (SELECT 1 FROM usage_runs r WHERE r.run_id = x.id)
      AND EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = x.id)
      AND NOT EXISTS (SELECT 1 FROM metering_pending p WHERE p.run_id = x.id)
    ON CONFLICT (run_id) DO NOTHING;
    RETURN QUERY
    WITH s AS (
        SELECT x.i::integer AS i, x.rid, x.sid, x.at, x.gpu, x.node, x.exporter, x.source, x.event_id
        FROM unnest(p_run_ids, p_sample_ids, p_observed_at, p_gpu, p_node, p_exporters, p_sources, p_event_ids)
             WITH ORDINALITY AS x(rid, sid, at, gpu, node, exporter, source, event_id, i)
    ), run AS (
        SELECT r.run_id AS rid, r.gpu_milli_hours_cumulative AS gpu, r.node_milli_hours_cumulative AS node, r.latest_observed_at AS latest
        FROM usage_runs r WHERE r.run_id IN (SELECT DISTINCT y.rid FROM s AS y)
    ), known AS (
        -- The samples of runs metering knows, each with the recorded sample of the same id and
        -- of the same time, and for one observed before the run's latest (late) the recorded
        -- samples either side of it; index probes only, whatever the run's history.
        SELECT s.i, s.rid, s.sid, s.at, s.gpu, s.node, run.gpu AS run_gpu, run.node AS run_node, run.latest,
               COALESCE(same_id.rid = s.rid AND same_id.sid = s.sid, false) AS has_id, same_id.at AS id_at, same_id.gpu AS id_gpu, same_id.node AS id_node,
               same_time.sid AS time_sid, same_time.gpu AS time_gpu, same_time.node AS time_node,
               before.gpu AS before_gpu, before.node AS before_node, after.gpu AS after_gpu, after.node AS after_node
        FROM s JOIN run USING (rid)
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
        -- Runs with a sample the set-based judgement does not cover: a conflict (same id or same
        -- time with other values, in the batch or recorded), or counters that go down.
        SELECT b.rid FROM by_time b
        WHERE (b.has_id AND (b.id_at, b.id_gpu, b.id_node) IS DISTINCT FROM (b.at, b.gpu, b.node))
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
