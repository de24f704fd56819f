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
