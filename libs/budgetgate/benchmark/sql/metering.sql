-- What `budgetgate bench metering` sets up and reads back.

-- name: decide_runs
-- An ALLOW decision per run id ($1 text[]), so metering-ingest knows every run of the load.
INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu,
                       request, response, decided_at)
SELECT gen_random_uuid(), r, 1, 'ALLOW', 'budgetgate bench metering', 'bench', '{}', 0, '{}', '{}', now()
FROM unnest($1::text[]) AS r;

-- name: consumed
-- Messages metering-ingest has taken care of (its polls' offsets, each message once, on a topic
-- made for the run), and the seconds from the start of its first transaction (applied_at is the
-- transaction's start) to now, both on the server's clock.
SELECT coalesce(sum(records), 0) AS done, extract(epoch FROM clock_timestamp() - min(applied_at))::float8 AS seconds
FROM consumer_offsets WHERE consumer = $1;

-- name: usage_rows
SELECT run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
       node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source,
       event_id, recorded_at
FROM usage_records ORDER BY run_id, observed_at;

-- name: run_totals
SELECT run_id, gpu_milli_hours_cumulative AS gpu, node_milli_hours_cumulative AS node, samples FROM usage_runs;
