-- Named queries of budgetgate.services.metering_ingest (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: lock_usage_run
-- Serialises everything that changes one run's usage (the Kafka consumer, HTTP ingest, the
-- pending re-check), across processes.
SELECT pg_advisory_xact_lock(7310, hashtext($1));

-- name: usage_run
SELECT gpu_milli_hours_cumulative, node_milli_hours_cumulative, latest_observed_at, max_gpus, max_nodes, first_decided_at
FROM usage_runs WHERE run_id = $1;

-- name: insert_usage_run
-- A run with a decision starts its usage, with its capacity as its decisions say (0029) and no
-- sample id recorded yet (0052).
INSERT INTO usage_runs (run_id, max_gpus, max_nodes, first_decided_at, max_sample_id)
SELECT c.run_id, c.max_gpus, c.max_nodes, c.first_decided_at, '' FROM metering_capacity(ARRAY[$1::text]) AS c
ON CONFLICT (run_id) DO NOTHING;

-- name: refresh_capacity
-- The capacity of runs $1 as their decisions say now (a later attempt may ask for more GPUs
-- than the one the run was introduced with), kept on their usage_runs rows.
UPDATE usage_runs r SET max_gpus = c.max_gpus, max_nodes = c.max_nodes, first_decided_at = c.first_decided_at
FROM metering_capacity($1::text[]) AS c
WHERE r.run_id = c.run_id
RETURNING r.run_id, r.max_gpus, r.max_nodes, r.first_decided_at;

-- name: usage_neighbours
-- The recorded samples a new one is judged against: the same sample id (by its usage record's
-- event id $4, within the months its run has records in), the same observed_at, the latest
-- observed before it and the earliest observed after it.
(SELECT 'same_id' AS role, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
 FROM usage_records u, usage_runs r
 WHERE r.run_id = $1 AND u.event_id = $4 AND u.observed_at >= COALESCE(r.earliest_observed_at, '-infinity')
   AND u.observed_at <= COALESCE(r.latest_observed_at, 'infinity') AND u.sample_id = $2
 LIMIT 1)
UNION ALL
(SELECT 'same_time', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at = $3)
UNION ALL
(SELECT 'before', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at < $3 ORDER BY observed_at DESC LIMIT 1)
UNION ALL
(SELECT 'after', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at > $3 ORDER BY observed_at LIMIT 1);

-- name: begin_sample
-- The run's lock, its state (with its capacity) and the recorded neighbours of a sample (see metering_begin_sample).
SELECT role, sample_id, observed_at, gpu_milli_hours, node_milli_hours, max_gpus, max_nodes, first_decided_at
FROM metering_begin_sample($1, $2, $3, $4);

-- name: record_usage
-- An accepted sample, its run's new high-water mark and the outbox row of its usage record
-- ($14 topic, $15 key, $16 payload, $17 headers): one statement, one round trip.
WITH recorded AS (
    INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours,
                               gpu_milli_hours_cumulative, node_milli_hours_cumulative, gpu_milli_hours_delta,
                               node_milli_hours_delta, late, exporter, source, event_id)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
), run AS (
    UPDATE usage_runs
    SET gpu_milli_hours_cumulative = $6, node_milli_hours_cumulative = $7, samples = samples + 1,
        latest_observed_at = GREATEST(latest_observed_at, $3), earliest_observed_at = LEAST(earliest_observed_at, $3),
        max_sample_id = usage_max_sample_id(max_sample_id, $2), updated_at = now()
    WHERE run_id = $1
)
INSERT INTO outbox (topic, key, payload, headers) VALUES ($14, $15, $16, $17);

-- name: metering_begin_batch
-- The runs' locks, their state and the recorded neighbours of every sample of a batch
-- (see metering_begin_batch).
SELECT idx, role, run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, max_gpus, max_nodes, first_decided_at
FROM metering_begin_batch($1::text[], $2::text[], $3::timestamptz[], $4::text[]);

-- name: metering_place_batch
-- A batch's samples judged and recorded set-based where the core's rules allow it, the others
-- left to the core (see metering_place_batch): one row per sample, by its 1-based idx ($12
-- false: none for an accepted sample that is neither its span's point nor late). The text
-- columns ($1, $2, $6, $7, $8) come joined, chr(31) before each; the times ($3) in microseconds
-- since the epoch (services/metering_ingest/store.py place_batch). $9 and $10: the usage
-- tolerance, in parts per million and the clock slack in microseconds; $11: the span of which a
-- run's accepted samples are one point (NULL: every sample its own).
SELECT idx, outcome, of_sample, gpu_cumulative, node_cumulative, gpu_delta, node_delta, late,
       record_order, record_gpu_cumulative, record_node_cumulative, record_gpu_delta, record_node_delta
FROM metering_place_batch((string_to_array($1::text, chr(31)))[2:], (string_to_array($2::text, chr(31)))[2:],
                          ARRAY(SELECT timestamptz 'epoch' + t.us * interval '1 microsecond'
                                FROM unnest($3::bigint[]) WITH ORDINALITY AS t(us, n) ORDER BY t.n),
                          $4::bigint[], $5::bigint[], (string_to_array($6::text, chr(31)))[2:],
                          (string_to_array($7::text, chr(31)))[2:], (string_to_array($8::text, chr(31)))[2:],
                          $9::bigint, $10::bigint, $11::interval, $12::boolean);

-- name: raise_usage_runs
-- The new high-water marks of the runs a batch recorded samples of: per run its cumulative
-- counters after the batch, how many samples it added and the latest and earliest observed_at
-- among them; $7 and $8, the run and sample id of each sample recorded, whose last id per run
-- (0052: in length then code point order, as Postgres counts and compares them) moves its mark.
UPDATE usage_runs r
SET gpu_milli_hours_cumulative = x.gpu, node_milli_hours_cumulative = x.node, samples = r.samples + x.added,
    latest_observed_at = GREATEST(r.latest_observed_at, x.latest), earliest_observed_at = LEAST(r.earliest_observed_at, x.earliest),
    max_sample_id = usage_max_sample_id(r.max_sample_id, t.top), updated_at = now()
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::integer[], $5::timestamptz[], $6::timestamptz[]) AS x(run_id, gpu, node, added, latest, earliest)
LEFT JOIN (SELECT y.run_id, (array_agg(y.sid ORDER BY length(y.sid) DESC, y.sid COLLATE "C" DESC))[1] AS top
           FROM unnest($7::text[], $8::text[]) AS y(run_id, sid) GROUP BY y.run_id) AS t ON t.run_id = x.run_id
WHERE r.run_id = x.run_id;

-- name: insert_pending
-- Keep a sample until its run is known, with its sender's limits ($11 the sender limited to
-- namespaces $12 and tenants $13; '' and none for a sender not limited). When one of the same id
-- from the same sender is kept already, the new one is not, and the kept one's payload comes
-- back (for the caller to tell a resend from a conflict).
WITH kept AS (
    INSERT INTO metering_pending (run_id, sample_id, observed_at, expires_at, source, topic, kafka_partition,
                                  kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
    ON CONFLICT (run_id, sample_id, sender) DO NOTHING
    RETURNING 1
)
SELECT p.payload, p.headers FROM metering_pending p
WHERE p.run_id = $1 AND p.sample_id = $2 AND p.sender = $11 AND NOT EXISTS (SELECT 1 FROM kept);

-- name: take_pending_of_run
DELETE FROM metering_pending WHERE run_id = $1
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants;

-- name: run_owners
-- The namespace and tenant (the value of label $2) of each run of $1 that has a decision, as its
-- latest decision names them (admission keeps both in every attempt of a run); one index probe a run.
SELECT DISTINCT ON (run_id) run_id, namespace, labels ->> $2 AS tenant
FROM decisions WHERE run_id = ANY($1::text[]) ORDER BY run_id, attempt DESC;

-- name: pending_runs_with_decision
SELECT DISTINCT p.run_id FROM metering_pending p
WHERE EXISTS (SELECT 1 FROM decision_keys d WHERE d.run_id = p.run_id) LIMIT $1;

-- name: take_expired_pending
-- Pending samples past their grace period whose run still has no decision, taken to be
-- dead-lettered in the same transaction. SKIP LOCKED: instances side by side share the work.
DELETE FROM metering_pending
WHERE (run_id, sample_id, sender) IN (
    SELECT p.run_id, p.sample_id, p.sender FROM metering_pending p
    WHERE p.expires_at <= $1 AND NOT EXISTS (SELECT 1 FROM decision_keys d WHERE d.run_id = p.run_id)
    ORDER BY p.expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants;

-- name: pending_count
SELECT count(*) FROM metering_pending;

