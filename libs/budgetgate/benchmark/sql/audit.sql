-- What budgetgate's ledger holds after a run, for the no-over-admission check.

-- name: ledger_totals
-- Per ledger key: the limit, metered consumption, and the GPU time held by admitted runs.
SELECT e.ledger_key AS budget, e.limit_amount, e.consumed,
       COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS admitted,
       COUNT(r.run_id) FILTER (WHERE r.state = 'held') AS allows
FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
GROUP BY e.ledger_key ORDER BY e.ledger_key;

-- name: allow_decisions
SELECT count(*) FROM decisions WHERE outcome = 'ALLOW';

-- name: outbox_state
-- Records in the outbox (a row may carry a bundle of them): not published yet, and in all.
SELECT COALESCE(sum(records) FILTER (WHERE published_at IS NULL), 0)::bigint AS pending, COALESCE(sum(records), 0)::bigint AS total FROM outbox;
