-- The baseline's schema and queries: one budget row per team, locked for every decision.

-- name: schema
CREATE TABLE budgets (
    budget_id    text PRIMARY KEY,
    namespace    text NOT NULL UNIQUE,
    limit_amount bigint NOT NULL CHECK (limit_amount >= 0),  -- milli-GPU-seconds
    reserved     bigint NOT NULL DEFAULT 0,
    consumed     bigint NOT NULL DEFAULT 0
);
CREATE TABLE decisions (
    run_id     text PRIMARY KEY,       -- a retry finds the first answer here
    budget_id  text REFERENCES budgets (budget_id),
    outcome    text NOT NULL CHECK (outcome IN ('ALLOW', 'DENY')),
    amount     bigint NOT NULL,
    response   jsonb NOT NULL,
    decided_at timestamptz NOT NULL DEFAULT now()
);

-- name: insert_budget
INSERT INTO budgets (budget_id, namespace, limit_amount) VALUES ($1, $2, $3);

-- name: lock_budget
-- Serialises every decision on one budget until commit.
SELECT budget_id, limit_amount, reserved, consumed FROM budgets WHERE namespace = $1 FOR UPDATE;

-- name: lock_budget_id
-- The shared scenario's budget every submission falls under, locked after the team's.
SELECT budget_id, limit_amount, reserved, consumed FROM budgets WHERE budget_id = $1 FOR UPDATE;

-- name: prior_decision
SELECT response FROM decisions WHERE run_id = $1;

-- name: reserve
UPDATE budgets SET reserved = reserved + $2 WHERE budget_id = $1;

-- name: insert_decision
INSERT INTO decisions (run_id, budget_id, outcome, amount, response) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (run_id) DO NOTHING RETURNING run_id;

-- name: totals
-- Per budget any submission reached (budgetgate files a ledger entry only for those): the
-- limit, the reserved counter, and what the ALLOW decisions add up to. Every decision falls
-- under the shared budget $1 as well (the shared scenario's; no row of other scenarios).
SELECT b.budget_id, b.limit_amount, b.reserved, b.consumed,
       COALESCE(SUM(d.amount) FILTER (WHERE d.outcome = 'ALLOW'), 0)::bigint AS admitted,
       COUNT(d.run_id) FILTER (WHERE d.outcome = 'ALLOW') AS allows
FROM budgets b LEFT JOIN decisions d ON d.budget_id = b.budget_id OR b.budget_id = $1
GROUP BY b.budget_id HAVING COUNT(d.run_id) > 0 OR b.reserved <> 0 ORDER BY b.budget_id;
