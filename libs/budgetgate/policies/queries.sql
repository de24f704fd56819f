-- Named queries of budgetgate.policies (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: insert_bundle
INSERT INTO policy_bundles (git_sha, documents, source, applied_by) VALUES ($1, $2, $3, $4)
ON CONFLICT (git_sha) DO NOTHING;

-- name: activate_bundle
INSERT INTO policy_activations (git_sha) VALUES ($1) RETURNING seq;

-- name: update_policy_limits
-- A new policy revision changes the limit of its current and future windows, never closed ones.
UPDATE ledger_entries SET limit_amount = $2, policy_git_sha = $3, updated_at = now()
WHERE policy_id = $1 AND unit = $4 AND (window_end IS NULL OR window_end > now());

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

