-- Named queries of the ledger, loaded by budgetgate.ledger.queries. One block per query.

-- name: lock_ledger_shared
-- Every transaction that changes reservations takes this; a Redis rebuild takes it exclusively,
-- so a rebuild never misses a reservation made in Redis but not yet committed here.
SELECT pg_advisory_xact_lock_shared(7301, 0);

-- name: lock_ledger_exclusive
SELECT pg_advisory_xact_lock(7301, 0);

-- name: lock_run
-- Serialises every decision about one run id, across processes.
SELECT pg_advisory_xact_lock(7302, hashtext($1));

-- name: latest_decision
SELECT decision_id, run_id, attempt, outcome, response, decided_at
FROM decisions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1;

-- name: decision_by_id
SELECT decision_id, run_id, attempt, outcome, response, decided_at FROM decisions WHERE decision_id = $1;

-- name: insert_decision
INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace,
                       job_name, policy_bundle_sha, projected_gpu, showback_micros, currency, request,
                       response, decided_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16);

-- name: insert_evaluation
INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, window_start,
                                  window_end, unit, enforcement, outcome, limit_amount, projected, remaining,
                                  admitted, deficit, next_eligible_time)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16);

-- name: insert_reservation
INSERT INTO reservations (run_id, ledger_key, decision_id, amount, expected_end)
VALUES ($1, $2, $3, $4, $5);

-- name: insert_outbox
INSERT INTO outbox (topic, key, payload, headers) VALUES ($1, $2, $3, $4);

-- name: ensure_ledger_entry
INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id,
                            policy_git_sha, limit_amount)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (ledger_key) DO NOTHING;

-- name: ledger_figures
-- Postgres's truth for ledger keys: consumed, and reserved as the sum of held reservations.
SELECT e.ledger_key, e.limit_amount, e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- name: all_ledger_figures
SELECT e.ledger_key, e.limit_amount, e.consumed,
       COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
GROUP BY e.ledger_key;

-- name: held_reservations
SELECT run_id, decision_id, ledger_key, amount, created_at FROM reservations WHERE state = 'held';

-- name: expected_releases
SELECT expected_end, amount FROM reservations
WHERE ledger_key = $1 AND state = 'held' ORDER BY expected_end;

-- name: release_run
UPDATE reservations SET state = 'released', ended_at = now(), end_reason = $2
WHERE run_id = $1 AND state = 'held' RETURNING ledger_key, amount;

-- name: claim_outbox
SELECT id, topic, key, payload, headers FROM outbox
WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED;

-- name: mark_published
UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[]);

-- name: outbox_backlog
SELECT count(*) AS pending, min(created_at) AS oldest FROM outbox WHERE published_at IS NULL;

-- name: insert_bundle
INSERT INTO policy_bundles (git_sha, documents, source, applied_by) VALUES ($1, $2, $3, $4)
ON CONFLICT (git_sha) DO NOTHING;

-- name: activate_bundle
INSERT INTO policy_activations (git_sha) VALUES ($1) RETURNING seq;

-- name: active_bundle
SELECT b.git_sha, b.documents, a.seq FROM policy_activations a JOIN policy_bundles b USING (git_sha)
ORDER BY a.seq DESC LIMIT 1;

-- name: update_policy_limits
-- A new policy revision changes the limit of its current and future windows, never closed ones.
UPDATE ledger_entries SET limit_amount = $2, policy_git_sha = $3, updated_at = now()
WHERE policy_id = $1 AND unit = $4 AND (window_end IS NULL OR window_end > now());

-- name: scope_figures
SELECT e.ledger_key, e.policy_id, e.policy_git_sha, e.unit, e.window_start, e.window_end, e.limit_amount,
       e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- metering-ingest ------------------------------------------------------------------------------

-- name: lock_usage_run
-- Serialises everything that changes one run's usage (the Kafka consumer, HTTP ingest, the
-- pending re-check), across processes.
SELECT pg_advisory_xact_lock(7310, hashtext($1));

-- name: usage_run
SELECT gpu_milli_hours_cumulative, node_milli_hours_cumulative, latest_observed_at
FROM usage_runs WHERE run_id = $1;

-- name: run_has_decision
SELECT EXISTS (SELECT 1 FROM decisions WHERE run_id = $1);

-- name: insert_usage_run
INSERT INTO usage_runs (run_id) VALUES ($1) ON CONFLICT (run_id) DO NOTHING;

-- name: usage_neighbours
-- The recorded samples a new one is judged against: the same sample id, the same observed_at,
-- the latest observed before it and the earliest observed after it.
(SELECT 'same_id' AS role, sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND sample_id = $2)
UNION ALL
(SELECT 'same_time', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at = $3)
UNION ALL
(SELECT 'before', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at < $3 ORDER BY observed_at DESC LIMIT 1)
UNION ALL
(SELECT 'after', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at > $3 ORDER BY observed_at LIMIT 1);

-- name: insert_usage_record
INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours,
                           gpu_milli_hours_cumulative, node_milli_hours_cumulative, gpu_milli_hours_delta,
                           node_milli_hours_delta, late, exporter, source, event_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13);

-- name: update_usage_run
UPDATE usage_runs
SET gpu_milli_hours_cumulative = $2, node_milli_hours_cumulative = $3, samples = samples + 1,
    latest_observed_at = GREATEST(latest_observed_at, $4), updated_at = now()
WHERE run_id = $1;

-- name: insert_pending
INSERT INTO metering_pending (run_id, sample_id, observed_at, expires_at, source, topic, kafka_partition,
                              kafka_offset, payload, headers)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (run_id, sample_id) DO NOTHING;

-- name: take_pending_of_run
DELETE FROM metering_pending WHERE run_id = $1
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers;

-- name: pending_runs_with_decision
SELECT DISTINCT p.run_id FROM metering_pending p
WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p.run_id) LIMIT $1;

-- name: take_expired_pending
-- Pending samples past their grace period whose run still has no decision, taken to be
-- dead-lettered in the same transaction. SKIP LOCKED: instances side by side share the work.
DELETE FROM metering_pending
WHERE (run_id, sample_id) IN (
    SELECT p.run_id, p.sample_id FROM metering_pending p
    WHERE p.expires_at <= $1 AND NOT EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p.run_id)
    ORDER BY p.expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers;

-- name: pending_count
SELECT count(*) FROM metering_pending;

-- name: run_usage
-- A run's metered usage so far (its high-water mark, which never goes down).
SELECT run_id, gpu_milli_hours_cumulative, node_milli_hours_cumulative, samples, latest_observed_at
FROM usage_runs WHERE run_id = $1;

-- name: run_usage_through
-- A run's usage as of a time: the counters of its latest sample observed at or before $2 (no
-- row: nothing yet). Usage in a window (a, b] is through(b) - through(a).
SELECT gpu_milli_hours, node_milli_hours, observed_at FROM usage_records
WHERE run_id = $1 AND observed_at <= $2 ORDER BY observed_at DESC LIMIT 1;
