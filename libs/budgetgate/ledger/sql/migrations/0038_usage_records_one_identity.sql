-- usage_records kept two unique indexes on one identity: (run_id, sample_id, observed_at), its
-- primary key, and (event_id, observed_at), the event id of a sample's usage record being derived
-- from its run and sample id (uuid5, budgetgate.core.metering.usage_event_id). Every sample paid
-- for both. The primary key goes (dropping an index is instant, however large the table): a
-- sample is about a fifth cheaper to record in Postgres's CPU, its WAL and its storage. The
-- (event_id, observed_at) constraint keeps a sample from being recorded twice, as before.
--
-- The lookups of a recorded sample by its id go by its event id now, within the months its run
-- has records in (usage_runs.earliest/latest_observed_at, so one partition's index or two are
-- probed), as metering_place_batch's did already: metering_begin_sample and metering_begin_batch
-- take the event ids as one more argument. The versions without it stay for processes of the
-- release before, until they are all replaced: they call the new ones without event ids, and a
-- sample without one is found by run and sample id, through the run's records (run_id,
-- observed_at): correct, but slower on a long run.
ALTER TABLE usage_records DROP CONSTRAINT usage_records_pkey;

CREATE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz, p_event_id text)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_earliest timestamptz;
    v_latest timestamptz;
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
    SELECT r.earliest_observed_at, r.latest_observed_at INTO v_earliest, v_latest FROM usage_runs r WHERE r.run_id = p_run_id;
    RETURN QUERY
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u
         WHERE p_event_id IS NOT NULL AND u.event_id = p_event_id
           AND u.observed_at >= COALESCE(v_earliest, '-infinity') AND u.observed_at <= COALESCE(v_latest, 'infinity') AND u.sample_id = p_sample_id
         LIMIT 1)
        UNION ALL
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE p_event_id IS NULL AND u.run_id = p_run_id AND u.sample_id = p_sample_id LIMIT 1)
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
ALTER FUNCTION metering_begin_sample(text, text, timestamptz, text) SET plan_cache_mode = force_custom_plan;

CREATE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_event_ids text[])
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
            SELECT x.rid, x.sid, x.at, x.eid, x.i FROM unnest(p_run_ids, p_sample_ids, p_observed_at, p_event_ids) WITH ORDINALITY AS x(rid, sid, at, eid, i)
        ), latest AS (
            -- The latest recorded sample of each run: one index probe per run.
            SELECT l.run_id, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours
            FROM (SELECT DISTINCT y.rid FROM s AS y) AS k
            CROSS JOIN LATERAL (SELECT u.run_id, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
                                FROM usage_records u WHERE u.run_id = k.rid ORDER BY u.observed_at DESC LIMIT 1) AS l
        )
        -- The recorded sample of the same id, by its usage record's event id, within the months
        -- its run has records in (without one, from the release before: by run and sample id).
        SELECT s.i::integer, 'same_id', s.rid, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN usage_runs r ON r.run_id = s.rid
        CROSS JOIN LATERAL (
            (SELECT u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u
             WHERE s.eid IS NOT NULL AND u.event_id = s.eid AND u.observed_at >= COALESCE(r.earliest_observed_at, '-infinity')
               AND u.observed_at <= COALESCE(r.latest_observed_at, 'infinity') AND u.sample_id = s.sid
             LIMIT 1)
            UNION ALL
            (SELECT u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE s.eid IS NULL AND u.run_id = s.rid AND u.sample_id = s.sid LIMIT 1)
        ) AS u
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
ALTER FUNCTION metering_begin_batch(text[], text[], timestamptz[], text[]) SET plan_cache_mode = force_custom_plan;

-- The versions of the release before, the same functions without event ids.
CREATE OR REPLACE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM metering_begin_sample(p_run_id, p_sample_id, p_observed_at, NULL::text)
$$;

CREATE OR REPLACE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[])
RETURNS TABLE (idx integer, role text, run_id text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM metering_begin_batch(p_run_ids, p_sample_ids, p_observed_at, NULL::text[])
$$;
