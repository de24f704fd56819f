-- 0040: metering_begin_sample (0038) read its run's usage_runs row twice, once for the 'run' row
-- it returns and once for the months the run has records in; it now reads it once, into a
-- variable, and answers both from it. CREATE OR REPLACE drops the function's settings, so its
-- plan_cache_mode (0038: planned for every call) is set again.
CREATE OR REPLACE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz, p_event_id text)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_run usage_runs%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(7310, hashtext(p_run_id));
    SELECT * INTO v_run FROM usage_runs r WHERE r.run_id = p_run_id;
    IF NOT FOUND THEN
        RETURN QUERY
            SELECT 'decision', NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz
            WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p_run_id);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 'run', NULL::text, v_run.latest_observed_at, v_run.gpu_milli_hours_cumulative, v_run.node_milli_hours_cumulative,
               v_run.max_gpus, v_run.max_nodes, v_run.first_decided_at;
    RETURN QUERY
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u
         WHERE p_event_id IS NOT NULL AND u.event_id = p_event_id
           AND u.observed_at >= COALESCE(v_run.earliest_observed_at, '-infinity')
           AND u.observed_at <= COALESCE(v_run.latest_observed_at, 'infinity') AND u.sample_id = p_sample_id
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
