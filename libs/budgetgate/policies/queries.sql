-- Named queries of budgetgate.policies (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: insert_bundle
INSERT INTO policy_bundles (git_sha, documents, source, applied_by) VALUES ($1, $2, $3, $4)
ON CONFLICT (git_sha) DO NOTHING;

-- name: activate_bundle
INSERT INTO policy_activations (git_sha) VALUES ($1) RETURNING seq;

-- name: update_policy_limits
-- A new policy revision changes the limit of its current and future windows, never closed ones:
-- $2 plus the grants of each window (migration 0031), never below zero.
UPDATE ledger_entries e SET limit_amount = GREATEST(0, $2 + COALESCE(
        (SELECT sum(g.amount) FROM budget_grants g WHERE g.policy_id = e.policy_id AND g.ledger_key = e.ledger_key), 0)),
    policy_git_sha = $3, updated_at = now()
WHERE e.policy_id = $1 AND e.unit = $4 AND (e.window_end IS NULL OR e.window_end > now());

-- name: bundle_differs
-- A SHA names one content: re-applying it with other documents is refused.
SELECT documents <> $2::jsonb FROM policy_bundles WHERE git_sha = $1;

-- name: bundle_documents
SELECT documents FROM policy_bundles WHERE git_sha = $1;

-- name: lock_overrides
-- Serialises changes of the override set (API updates, a Git apply) across processes.
SELECT pg_advisory_xact_lock(7320, 0);

-- name: overrides_at
-- Every tenant's override set as it stood at revision $1.
SELECT DISTINCT ON (tenant) revision, tenant, settings, actor, cause, reason, changed_at
FROM tenant_overrides WHERE revision <= $1 ORDER BY tenant, revision DESC;

-- name: insert_override
-- A tenant's new override set ($2 jsonb), one revision; returns it.
INSERT INTO tenant_overrides (tenant, settings, actor, cause, reason, git_sha) VALUES ($1, $2::jsonb, $3, $4, $5, $6)
RETURNING revision, changed_at;

-- waiting runs and HEADROOM (libs/budgetgate/ledger/waiting_runs.py, services/reconciler/headroom.py) ---

-- budget grants (migration 0031, policies/grant_store.py) ---

-- name: grants_at
-- Every grant made at or before revision $1, oldest first.
SELECT revision, policy_id, scope_id, unit, ledger_key, window_start, window_end, amount, limit_before, limit_after,
       actor, reason, git_sha, granted_at
FROM budget_grants WHERE revision <= $1 ORDER BY revision;

-- name: insert_grant
INSERT INTO budget_grants (policy_id, scope_id, unit, ledger_key, window_start, window_end, amount, limit_before,
                           limit_after, actor, reason, git_sha)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
RETURNING revision, granted_at;

-- name: set_window_limit
-- The limit of one window's ledger entry, when it has one (a window no decision has touched yet
-- gets its limit, grants included, when its entry is made).
UPDATE ledger_entries SET limit_amount = $2, updated_at = now() WHERE ledger_key = $1 AND policy_id = $3;
