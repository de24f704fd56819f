-- 0012_audit_room: the audit views agree with when a budget has room (core/eligibility.py).
-- A budget ran out at the first decision that found or left it with no room at all; a run
-- turned away for being larger than the room left did not exhaust it (the budget still had
-- room, and the DELAY names the instant it will have enough).

DROP VIEW audit_window_exhaustion;
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
    WHERE ev.remaining IS NOT NULL AND ev.remaining - ev.admitted <= 0
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
