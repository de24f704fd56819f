-- Named queries of budgetgate.evidence (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: evidence_insert_event
-- One OpenLineage event per consumed message; a redelivered message adds nothing.
INSERT INTO evidence_events (source_event_id, stage, run_id, run_uuid, decision_id, event_type, event_time, payload, state)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (source_event_id) DO NOTHING;

-- name: evidence_waiting_for_run
SELECT seq, payload FROM evidence_events WHERE run_id = $1 AND state = 'waiting' ORDER BY seq FOR UPDATE;

-- name: evidence_settle_waiting
-- A waiting reconciliation event, rebuilt on its decision's facet (and typed again, $3, after its
-- decision's own event), released to the sender.
UPDATE evidence_events SET payload = $2, event_type = $3, state = 'pending', next_attempt_at = now() WHERE seq = $1 AND state = 'waiting';

-- name: evidence_waiting_decided
-- Runs with a reconciliation waiting for a decision that is stored (the two consumed at the same
-- time, each transaction missing the other's row): handlers.release_decided releases them.
SELECT DISTINCT w.run_id FROM evidence_events w
WHERE w.state = 'waiting'
  AND EXISTS (SELECT 1 FROM evidence_events d
              WHERE d.run_id = w.run_id AND d.stage = 'decision' AND (w.decision_id IS NULL OR d.decision_id = w.decision_id))
LIMIT $1;

-- name: evidence_release_stale
-- Reconciliations whose decision never came within $1 seconds go out with the inferred one.
UPDATE evidence_events SET state = 'pending', next_attempt_at = now()
WHERE state = 'waiting' AND created_at < now() - make_interval(secs => $1);

-- name: evidence_decision_event
-- The event of the decision a reconciliation settles: that decision's when named, else the run's latest.
SELECT payload FROM evidence_events
WHERE run_id = $1 AND stage = 'decision' AND ($2::text IS NULL OR decision_id = $2)
ORDER BY seq DESC LIMIT 1;

-- name: evidence_terminal_sent
-- Whether the run's current life has its terminal event already: a COMPLETE, FAIL or ABORT of the
-- decision of its latest START (or of no named decision), or of any decision when it never
-- started. An attempt refused (ABORT) and a later one admitted (START) start the run again in
-- Marquez, and that life's own end must go out as terminal, not as OTHER; counted by decision,
-- not by order of storing, because a reconciliation that waited for its decision is stored first.
-- Events still waiting for their decision do not count: they are typed again when released.
SELECT EXISTS (SELECT 1 FROM evidence_events t
               WHERE t.run_id = $1 AND t.event_type IN ('COMPLETE', 'FAIL', 'ABORT') AND t.state <> 'waiting'
                 AND (t.decision_id IS NULL
                      OR t.decision_id = COALESCE((SELECT s.decision_id FROM evidence_events s
                                                   WHERE s.run_id = $1 AND s.event_type = 'START'
                                                   ORDER BY s.seq DESC LIMIT 1), t.decision_id)));

-- name: evidence_insert_reconciliation
INSERT INTO evidence_reconciliations (event_id, run_id, decision_id, final_state, terminal, provisional,
                                      policy_git_sha, projected_gpu, actual_gpu, reconciled_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (event_id) DO NOTHING;

-- name: evidence_insert_charges
INSERT INTO evidence_reconciliation_charges (event_id, ledger_key, scope_id, window_key, window_start, window_end,
                                             policy_id, unit, amount)
SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::timestamptz[],
                         $7::text[], $8::text[], $9::bigint[])
ON CONFLICT DO NOTHING;

-- name: evidence_next_batch
-- Pending events due now, oldest first, at most one per run: a run's later events (by event
-- time) wait for its earlier ones, so Marquez sees each run's transitions in order.
SELECT e.seq, e.payload, e.attempts FROM evidence_events e
WHERE e.state = 'pending' AND e.next_attempt_at <= now()
  AND NOT EXISTS (SELECT 1 FROM evidence_events b
                  WHERE b.run_uuid = e.run_uuid AND b.state = 'pending'
                    AND (b.event_time, b.seq) < (e.event_time, e.seq))
ORDER BY e.seq LIMIT $1;

-- name: evidence_mark_delivered
UPDATE evidence_events SET state = 'delivered', delivered_at = now(), attempts = attempts + 1, last_error = NULL
WHERE seq = $1;

-- name: evidence_mark_retry
UPDATE evidence_events
SET attempts = attempts + 1, last_error = $2, next_attempt_at = now() + make_interval(secs => $3)
WHERE seq = $1 AND state = 'pending';

-- name: evidence_mark_dead
WITH dead AS (
    UPDATE evidence_events SET state = 'dead', attempts = attempts + 1, last_error = $4
    WHERE seq = $1 RETURNING seq
)
INSERT INTO evidence_dead_letters (seq, status_code, body)
SELECT seq, $2, $3 FROM dead
ON CONFLICT (seq) DO NOTHING;

-- name: evidence_dead_list
-- Dead-lettered evidence events, oldest first: what was refused or kept failing, and why.
SELECT e.seq, e.run_id, e.stage, e.event_type, e.event_time, e.attempts, e.last_error, d.status_code, d.body, d.dead_at
FROM evidence_events e LEFT JOIN evidence_dead_letters d ON d.seq = e.seq
WHERE e.state = 'dead' AND ($1::bigint[] IS NULL OR e.seq = ANY($1::bigint[]))
ORDER BY e.seq LIMIT $2;

-- name: evidence_resend
-- Dead-lettered events ($1 their seqs; NULL: every one) back to pending, due now, with their
-- dead letters removed; returns the seqs. The sender delivers them in their runs' order again.
WITH back AS (
    UPDATE evidence_events SET state = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL
    WHERE state = 'dead' AND ($1::bigint[] IS NULL OR seq = ANY($1::bigint[]))
    RETURNING seq
), forgotten AS (
    DELETE FROM evidence_dead_letters d USING back WHERE d.seq = back.seq
)
SELECT seq FROM back ORDER BY seq;

-- name: evidence_backlog
SELECT count(*) AS pending,
       COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_seconds
FROM evidence_events WHERE state IN ('pending', 'waiting');

-- name: audit_denial_rate_for_scope
-- $2: an instant the window must contain, $3: a window key; both NULL: every window.
SELECT scope_id, window_key, window_start, window_end, runs, allowed, denied, delayed, denial_rate
FROM audit_denial_rate
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start NULLS LAST, window_key NULLS LAST;

-- name: audit_reservation_error_for_scope
SELECT scope_id, window_key, window_start, window_end, policy_git_sha, runs, provisional_runs,
       reserved_gpu, actual_gpu, error_gpu, abs_error_gpu, error_ratio
FROM audit_reservation_error
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start NULLS LAST, window_key, policy_git_sha;

-- name: audit_window_exhaustion_for_scope
SELECT ledger_key, scope_id, policy_id, policy_git_sha, unit, window_key, window_start, window_end,
       limit_amount, used, burn_per_hour, exhausted_at, projected_exhaustion_at
FROM audit_window_exhaustion
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start, policy_id;

-- name: audit_decisions_by_policy_sha_for_scope
-- As audit_decisions_by_policy_sha, for the decisions filed in the windows $2/$3 select (a label
-- violation, decided before any window, counts only when no window is asked for).
SELECT ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement,
       count(*)                                       AS decisions,
       count(*) FILTER (WHERE ev.outcome = 'ALLOW')   AS allowed,
       count(*) FILTER (WHERE ev.outcome = 'DENY')    AS denied,
       count(*) FILTER (WHERE ev.outcome = 'DELAY')   AS delayed,
       min(ev.decided_at)                             AS first_decided_at,
       max(ev.decided_at)                             AS last_decided_at
FROM decision_evaluations ev
LEFT JOIN ledger_entries le ON le.ledger_key = ev.ledger_key
WHERE ev.scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (COALESCE(le.window_start, ev.window_start) <= $2 AND $2 < COALESCE(le.window_end, ev.window_end))
       OR le.window_key = $3)
GROUP BY ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement
ORDER BY policy_id, first_decided_at;

-- name: audit_scope_known
-- Whether the ledger or a decision ever named the scope.
SELECT EXISTS (SELECT 1 FROM ledger_entries WHERE scope_id = $1)
    OR EXISTS (SELECT 1 FROM decision_evaluations WHERE scope_id = $1);

-- quotas and pools

