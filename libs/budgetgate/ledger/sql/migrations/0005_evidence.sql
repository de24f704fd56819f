-- 0005_evidence: the evidence-emitter's delivery state, the reconciliations it consumed, and
-- the audit views (one per question the design asks).

-- Every OpenLineage event, stored in the transaction that consumed its source message and then
-- delivered by the sender: `delivered` is what keeps a restart from sending it again. A
-- reconciliation consumed before its decision `waits` for it (or for a timeout), so its facet
-- carries the decision's evaluations.
CREATE TABLE evidence_events (
    seq             bigserial PRIMARY KEY,
    source_event_id text NOT NULL UNIQUE,   -- event id of the decision / reconciliation message
    stage           text NOT NULL CHECK (stage IN ('decision', 'reconciliation')),
    run_id          text NOT NULL,          -- the platform's stable run id
    run_uuid        uuid NOT NULL,          -- the OpenLineage runId derived from it
    decision_id     text,
    event_type      text NOT NULL CHECK (event_type IN ('START', 'RUNNING', 'COMPLETE', 'ABORT', 'FAIL', 'OTHER')),
    event_time      timestamptz NOT NULL,
    payload         jsonb NOT NULL,         -- the RunEvent as sent
    state           text NOT NULL DEFAULT 'pending' CHECK (state IN ('waiting', 'pending', 'delivered', 'dead')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz
);
CREATE INDEX evidence_events_pending ON evidence_events (next_attempt_at, seq) WHERE state = 'pending';
CREATE INDEX evidence_events_pending_run ON evidence_events (run_uuid, event_time, seq) WHERE state = 'pending';
CREATE INDEX evidence_events_waiting ON evidence_events (run_id) WHERE state = 'waiting';
CREATE INDEX evidence_events_run ON evidence_events (run_id, seq);

-- Events the receiver refused (4xx): kept with its answer, never retried.
CREATE TABLE evidence_dead_letters (
    seq         bigint PRIMARY KEY REFERENCES evidence_events (seq),
    status_code integer,
    body        text NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now()
);

-- The budget.reconciliations.v1 messages consumed, as the audit views need them.
CREATE TABLE evidence_reconciliations (
    event_id       text PRIMARY KEY,
    run_id         text NOT NULL,
    decision_id    text,
    final_state    text NOT NULL,
    terminal       boolean NOT NULL,        -- the run has ended (COMPLETED, FAILED, CANCELLED, ...)
    provisional    boolean NOT NULL,
    policy_git_sha text NOT NULL,
    projected_gpu  bigint NOT NULL,         -- milli-GPU-seconds, as everywhere in the ledger
    actual_gpu     bigint NOT NULL,
    reconciled_at  timestamptz NOT NULL,
    seq            bigserial NOT NULL
);
CREATE INDEX evidence_reconciliations_run ON evidence_reconciliations (run_id, reconciled_at);

CREATE TABLE evidence_reconciliation_charges (
    event_id     text NOT NULL REFERENCES evidence_reconciliations (event_id),
    ledger_key   text NOT NULL,
    scope_id     text NOT NULL,
    window_key   text NOT NULL,
    window_start timestamptz,
    window_end   timestamptz,
    policy_id    text,
    unit         text NOT NULL,
    amount       bigint NOT NULL,
    PRIMARY KEY (event_id, ledger_key)
);

-- Denial rate by scope and window: runs counted once, by their latest decision (a platform's
-- retries reuse the run id, and Marquez keeps one run per run id). Label violations are judged
-- before any ledger and have no window.
CREATE VIEW audit_denial_rate AS
WITH latest AS (
    SELECT DISTINCT ON (run_id) decision_id, run_id, outcome
    FROM decisions ORDER BY run_id, attempt DESC
)
SELECT ev.scope_id,
       le.window_key,
       le.window_start,
       le.window_end,
       count(DISTINCT l.run_id)                                      AS runs,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'ALLOW')   AS allowed,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DENY')    AS denied,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DELAY')   AS delayed,
       round(count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DENY')::numeric
             / count(DISTINCT l.run_id), 4)                         AS denial_rate
FROM latest l
JOIN decision_evaluations ev ON ev.decision_id = l.decision_id
LEFT JOIN ledger_entries le ON le.ledger_key = ev.ledger_key
GROUP BY ev.scope_id, le.window_key, le.window_start, le.window_end;

-- Reservation-to-actual error by scope, window and policy SHA, over each run's latest
-- reconciliation once the run has ended. GPU amounts in milli-GPU-seconds.
CREATE VIEW audit_reservation_error AS
WITH latest AS (
    SELECT DISTINCT ON (run_id) *
    FROM evidence_reconciliations ORDER BY run_id, reconciled_at DESC, seq DESC
), scoped AS (
    SELECT DISTINCT r.run_id, c.scope_id, c.window_key, c.window_start, c.window_end, r.policy_git_sha,
           r.projected_gpu, r.actual_gpu, r.provisional
    FROM latest r JOIN evidence_reconciliation_charges c ON c.event_id = r.event_id
    WHERE r.terminal
)
SELECT scope_id,
       window_key,
       window_start,
       window_end,
       policy_git_sha,
       count(*)                                   AS runs,
       count(*) FILTER (WHERE provisional)        AS provisional_runs,
       sum(projected_gpu)::bigint                 AS reserved_gpu,
       sum(actual_gpu)::bigint                    AS actual_gpu,
       sum(actual_gpu - projected_gpu)::bigint    AS error_gpu,
       sum(abs(actual_gpu - projected_gpu))::bigint AS abs_error_gpu,
       round(sum(actual_gpu - projected_gpu)::numeric / nullif(sum(projected_gpu), 0), 4) AS error_ratio
FROM scoped
GROUP BY scope_id, window_key, window_start, window_end, policy_git_sha;

-- Window exhaustion: when each calendar-window budget ran out, or when it will at its burn rate
-- so far. It ran out at the first decision that left it no room, or that turned away a run
-- which would have fitted the empty window. Used = consumed + held reservations.
CREATE VIEW audit_window_exhaustion AS
WITH figures AS (
    SELECT e.ledger_key, e.scope_id, e.policy_id, e.policy_git_sha, e.unit, e.window_key,
           e.window_start, e.window_end, e.limit_amount, e.consumed,
           COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS reserved
    FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
    WHERE e.window_start IS NOT NULL
    GROUP BY e.ledger_key
), ran_out AS (
    SELECT ev.ledger_key, min(d.decided_at) AS exhausted_at
    FROM decision_evaluations ev JOIN decisions d ON d.decision_id = ev.decision_id
    WHERE ev.remaining IS NOT NULL
      AND (ev.remaining - ev.admitted <= 0
           OR (ev.outcome IN ('DENY', 'DELAY') AND ev.deficit > 0 AND ev.projected <= ev.limit_amount))
    GROUP BY ev.ledger_key
), burn AS (
    SELECT f.*, f.consumed + f.reserved AS used,
           extract(epoch FROM least(now(), f.window_end) - f.window_start) AS elapsed_seconds
    FROM figures f
)
SELECT b.ledger_key, b.scope_id, b.policy_id, b.policy_git_sha, b.unit, b.window_key,
       b.window_start, b.window_end, b.limit_amount, b.used,
       CASE WHEN b.elapsed_seconds > 0 THEN round(b.used * 3600 / b.elapsed_seconds) END::bigint AS burn_per_hour,
       o.exhausted_at,
       CASE WHEN o.exhausted_at IS NULL AND b.used > 0 AND b.used < b.limit_amount AND b.elapsed_seconds > 0
                 AND now() < b.window_end
                 AND b.window_start + make_interval(secs => b.limit_amount * b.elapsed_seconds / b.used) < b.window_end
            THEN b.window_start + make_interval(secs => b.limit_amount * b.elapsed_seconds / b.used)
       END AS projected_exhaustion_at
FROM burn b LEFT JOIN ran_out o ON o.ledger_key = b.ledger_key;

-- Decisions by policy SHA: what each policy revision answered, so a change in enforcement is
-- attributable to the revision that made it.
CREATE VIEW audit_decisions_by_policy_sha AS
SELECT ev.policy_id,
       ev.policy_git_sha,
       ev.scope_id,
       ev.enforcement,
       count(*)                                       AS decisions,
       count(*) FILTER (WHERE ev.outcome = 'ALLOW')   AS allowed,
       count(*) FILTER (WHERE ev.outcome = 'DENY')    AS denied,
       count(*) FILTER (WHERE ev.outcome = 'DELAY')   AS delayed,
       min(d.decided_at)                              AS first_decided_at,
       max(d.decided_at)                              AS last_decided_at
FROM decision_evaluations ev JOIN decisions d ON d.decision_id = ev.decision_id
GROUP BY ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement;

-- The evidence not yet delivered, for dashboards (the emitter exports the same as metrics).
CREATE VIEW audit_evidence_backlog AS
SELECT count(*) FILTER (WHERE state IN ('pending', 'waiting'))                        AS pending,
       count(*) FILTER (WHERE state = 'dead')                                           AS dead,
       count(*) FILTER (WHERE state = 'delivered')                                      AS delivered,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('pending', 'waiting'))) AS oldest_pending_seconds
FROM evidence_events;
