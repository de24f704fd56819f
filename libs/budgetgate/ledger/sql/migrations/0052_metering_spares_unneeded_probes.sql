-- 0052: a sample's probe for a recorded sample of its id is spared when no recorded id can be its.
-- usage_runs.max_sample_id is the last of the ids the run has recorded, in length then code point
-- order ('' for a run metering started: none yet; NULL: unknown, for the runs started before this
-- migration and rows written by anything but metering, whose samples are all probed as before).
-- Every writer of a run's usage records keeps it (metering_place_batch, record_usage,
-- raise_usage_runs). Sample ids that grow in that order as time goes on (a counter, a
-- timestamp: the DCGM meter's exporter@milliseconds) spare the probe for every new sample, which
-- was a sixth of the statement's cost (bench metering-statement).
ALTER TABLE usage_runs ADD COLUMN max_sample_id text COLLATE "C";

-- The later of `kept` and `added` in that order; NULL (unknown) stays NULL, and no id added keeps it.
CREATE FUNCTION usage_max_sample_id(kept text, added text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN kept IS NULL OR added IS NULL THEN kept
                WHEN (length(added), added COLLATE "C") > (length(kept), kept COLLATE "C") THEN added
                ELSE kept END
$$;

CREATE OR REPLACE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[], p_tolerance_ppm bigint, p_slack_us bigint, p_fold interval,
    p_every boolean
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean,
               record_order integer, record_gpu_cumulative bigint, record_node_cumulative bigint,
               record_gpu_delta bigint, record_node_delta bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    INSERT INTO usage_runs (run_id, max_gpus, max_nodes, first_decided_at, max_sample_id)
    SELECT c.run_id, c.max_gpus, c.max_nodes, c.first_decided_at, ''
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
               r.max_gpus, r.max_nodes, r.first_decided_at AS since, r.earliest_observed_at AS earliest, r.max_sample_id AS max_sid
        FROM usage_runs r WHERE r.run_id IN (SELECT DISTINCT y.rid FROM s AS y)
    ), probed AS (
        -- The samples of runs metering knows, each with the recorded sample of the same id.
        SELECT s.i, s.rid, s.sid, s.at, s.gpu, s.node, run.gpu AS run_gpu, run.node AS run_node, run.latest,
               COALESCE(same_id.rid = s.rid AND same_id.sid = s.sid, false) AS has_id, same_id.at AS id_at, same_id.gpu AS id_gpu, same_id.node AS id_node,
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
        -- in (its earliest and latest observed_at), so only their partitions are read. 0052: not
        -- for a sample id after every id the run has recorded (max_sample_id, in length then
        -- code point order): none can be of that id, and a condition on the outer row alone
        -- spares the whole probe.
        LEFT JOIN LATERAL (SELECT u.run_id AS rid, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u
                           WHERE NOT (run.max_sid IS NOT NULL
                                      AND (length(s.sid), s.sid COLLATE "C") > (length(run.max_sid), run.max_sid COLLATE "C"))
                             AND u.event_id = s.event_id AND u.observed_at >= COALESCE(run.earliest, '-infinity')
                             AND u.observed_at <= COALESCE(run.latest, 'infinity')
                           LIMIT 1) AS same_id ON true
    ), known AS (
        -- Each with the recorded samples of the same time and, for one observed before the run's
        -- latest (late), either side of it; index probes only, whatever the run's history. 0051:
        -- probed only for a sample observed at or before its run's latest. A poll's samples of a
        -- run are mostly after it, with nothing recorded at or after their time, and each probe
        -- of the partitioned table cost its setup even where its condition was false.
        SELECT p.*, NULL::text AS time_sid, NULL::bigint AS time_gpu, NULL::bigint AS time_node, NULL::bigint AS before_gpu,
               NULL::bigint AS before_node, NULL::bigint AS after_gpu, NULL::bigint AS after_node, false AS covered, NULL::text AS after_sid
        FROM probed p WHERE p.latest IS NULL OR p.at > p.latest
        UNION ALL
        SELECT p.*, same_time.sid, same_time.gpu, same_time.node, before.gpu, before.node, after.gpu, after.node,
               -- 0046: a late sample in the quarter hour (p_fold) of a recorded point after it changes
               -- nothing a max-register keeps: a duplicate of that point (unless odd, below).
               (p_fold IS NOT NULL AND after.at IS NOT NULL
                AND date_bin(p_fold, after.at, timestamptz '2000-01-01 00:00:00+00') = date_bin(p_fold, p.at, timestamptz '2000-01-01 00:00:00+00')),
               after.sid
        FROM probed p
        LEFT JOIN LATERAL (SELECT u.sample_id AS sid, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u WHERE u.run_id = p.rid AND u.observed_at = p.at LIMIT 1) AS same_time ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node FROM usage_records u
                           WHERE u.run_id = p.rid AND u.observed_at < p.at AND p.at < p.latest
                           ORDER BY u.observed_at DESC LIMIT 1) AS before ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node, u.observed_at AS at, u.sample_id AS sid FROM usage_records u
                           WHERE u.run_id = p.rid AND u.observed_at > p.at AND p.at < p.latest
                           ORDER BY u.observed_at LIMIT 1) AS after ON true
        WHERE p.at <= p.latest
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
        SELECT b.*, b.time_sid IS NULL AND b.prev_at IS DISTINCT FROM b.at AND NOT b.covered AS accepted
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
    ), folded AS (
        -- 0046: a run's accepted samples of one quarter hour (p_fold) in this batch are one point,
        -- the latest of them: one usage row and one usage record, whose delta is the sum of the
        -- quarter hour's deltas and whose cumulative is the run's high-water mark after them.
        -- Usage up to any quarter hour (every window boundary, hour bucket and rate change is
        -- one) is the latest point before it, which is kept (a point on the quarter hour starts
        -- the next: the reconciler charges an increment to the window, bucket and rate of its
        -- end). p_fold NULL: every sample is its own point (accepted samples of a run never
        -- share an observed_at).
        SELECT a.*, row_number() OVER (PARTITION BY a.rid, a.slot ORDER BY a.at DESC) = 1 AS kept,
               max(a.i) OVER g AS rec_i, max(a.cum_gpu) OVER g AS rec_gpu, max(a.cum_node) OVER g AS rec_node,
               (sum(a.cum_gpu - a.was_gpu) OVER g)::bigint AS rec_gpu_delta, (sum(a.cum_node - a.was_node) OVER g)::bigint AS rec_node_delta
        FROM (SELECT a.*, CASE WHEN p_fold IS NULL THEN a.at ELSE date_bin(p_fold, a.at, timestamptz '2000-01-01 00:00:00+00') END AS slot
              FROM accepted a) AS a
        WINDOW g AS (PARTITION BY a.rid, a.slot)
    ), recorded AS (
        INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                                   node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id)
        SELECT f.rid, f.sid, f.at, f.gpu, f.node, f.rec_gpu, f.rec_node, f.rec_gpu_delta, f.rec_node_delta, f.is_late,
               s.exporter, s.source, s.event_id
        FROM folded f JOIN s USING (i) WHERE f.kept
    ), raised AS (
        UPDATE usage_runs r
        SET gpu_milli_hours_cumulative = x.gpu, node_milli_hours_cumulative = x.node, samples = r.samples + x.added,
            latest_observed_at = GREATEST(r.latest_observed_at, x.latest), earliest_observed_at = LEAST(r.earliest_observed_at, x.earliest),
            max_sample_id = usage_max_sample_id(r.max_sample_id, x.top), updated_at = now()
        -- 0052: from folded, whose rows are accepted's, with the last id recorded (kept).
        FROM (SELECT a.rid, max(a.cum_gpu) AS gpu, max(a.cum_node) AS node, count(*)::integer AS added, max(a.at) AS latest, min(a.at) AS earliest,
                     (array_agg(a.sid ORDER BY length(a.sid) DESC, a.sid COLLATE "C" DESC) FILTER (WHERE a.kept))[1] AS top
              FROM folded a GROUP BY a.rid) AS x
        WHERE r.run_id = x.rid
    )
    -- An accepted sample kept as its quarter hour's point also says what its usage record
    -- carries, and where it goes among the run's records (record_order: the batch index of the
    -- quarter hour's last sample, so a run's records raise its cumulative in order).
    SELECT f.i, 'accepted', NULL::text, f.cum_gpu, f.cum_node, f.cum_gpu - f.was_gpu, f.cum_node - f.was_node, f.is_late,
           CASE WHEN f.kept THEN f.rec_i END, CASE WHEN f.kept THEN f.rec_gpu END, CASE WHEN f.kept THEN f.rec_node END,
           CASE WHEN f.kept THEN f.rec_gpu_delta END, CASE WHEN f.kept THEN f.rec_node_delta END
    FROM folded f
    -- 0051: without p_every, an accepted sample that is neither its quarter hour's point nor late
    -- has no row (a poll read from Kafka counts it; its own figures are read by no one).
    WHERE p_every OR f.kept OR f.is_late
    UNION ALL
    -- A duplicate of the recorded sample of its id, or of the first sample of its observed_at,
    -- recorded or accepted earlier in the batch.
    SELECT c.i, 'duplicate', CASE WHEN c.has_id THEN c.sid ELSE COALESCE(c.time_sid, CASE WHEN c.covered THEN c.after_sid END, c.first_sid) END,
           NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean, NULL::integer, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint
    FROM clean c WHERE NOT c.accepted
    UNION ALL
    SELECT s.i, 'python', NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean,
           NULL::integer, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint
    FROM s WHERE s.i NOT IN (SELECT c.i FROM clean c);
END
$$;
ALTER FUNCTION metering_place_batch(text[], text[], timestamptz[], bigint[], bigint[], text[], text[], text[], bigint, bigint, interval, boolean)
    SET plan_cache_mode = force_custom_plan;  -- 0019, 0029 (CREATE OR REPLACE cleared it)
