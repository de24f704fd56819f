-- 0015_tenant_overrides: tenant quotas and budgets changed over the API (`PUT /v1/tenants/{tenant}`)
-- on top of the Git bundle, versioned. Each row is one revision: the tenant's whole override set
-- after a change (`{}`: none left), who made it and why. Revisions count up across every tenant,
-- so one number (recorded with each decision beside the bundle's Git SHA) pins the override set
-- a decision was made under. Admission reads the highest revision in the same call that begins
-- a batch (budgetgate_begin_batch), so a change takes effect on the very next decision.

CREATE TABLE tenant_overrides (
    revision   bigserial PRIMARY KEY,
    tenant     text NOT NULL,
    -- field -> {"value", "git" (the Git value it was set against), and for budgets "policy_id",
    -- "unit" and "amount" (the limit in ledger units)}; see budgetgate/core/overrides.py
    settings   jsonb NOT NULL,
    actor      text NOT NULL,
    cause      text NOT NULL CHECK (cause IN ('api', 'policy.apply')),
    reason     text,
    git_sha    text,           -- the active bundle when the change was made
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tenant_overrides_tenant ON tenant_overrides (tenant, revision DESC);

-- Every tenant's override set at its latest revision (tenants whose overrides were all cleared
-- have `{}`).
CREATE VIEW tenant_overrides_current AS
SELECT DISTINCT ON (tenant) revision, tenant, settings, actor, cause, reason, git_sha, changed_at
FROM tenant_overrides ORDER BY tenant, revision DESC;

ALTER TABLE decisions ADD COLUMN override_revision bigint;

-- The first row now also carries the highest override revision committed.
DROP FUNCTION budgetgate_begin_batch(text[]);
CREATE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7301, 0);
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(7302, lock_key);
    END LOOP;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               COALESCE((SELECT max(d.ledger_seq) FROM decisions d WHERE d.ledger_seq IS NOT NULL), 0)::bigint,
               COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0)::bigint;
    RETURN QUERY
        SELECT DISTINCT ON (d.run_id) d.run_id, d.decision_id, d.attempt, d.outcome, d.request, d.response,
               NULL::bigint, NULL::bigint
        FROM decisions d WHERE d.run_id = ANY(p_run_ids) ORDER BY d.run_id, d.attempt DESC;
END
$$;
