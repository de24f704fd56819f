-- 0031_budget_grants: hours (or money) granted to, or taken from, one budget in one window over
-- the API (`POST /v1/budgets/{policy_id}/grants`, `budgetgate grant add`), on top of the Git
-- limit. Each row is one grant, never changed: the window's limit is the policy's limit plus the
-- sum of its grants (never below zero). A grant takes its revision from the tenant override
-- sequence, so one number recorded with each decision (decisions.override_revision) pins the
-- overrides and the grants it was made under, and a new grant reaches the next batch of
-- decisions on every instance as a new override revision does.

CREATE TABLE budget_grants (
    revision     bigint PRIMARY KEY DEFAULT nextval('tenant_overrides_revision_seq'),
    policy_id    text NOT NULL,
    scope_id     text NOT NULL,
    unit         text NOT NULL CHECK (unit IN ('gpu_hours', 'node_hours', 'wall_hours', 'cost')),
    ledger_key   text NOT NULL,
    window_start timestamptz NOT NULL,
    window_end   timestamptz NOT NULL,
    amount       bigint NOT NULL CHECK (amount <> 0),   -- in the ledger's units; negative takes away
    limit_before bigint NOT NULL,                        -- the window's limit before and after it
    limit_after  bigint NOT NULL CHECK (limit_after >= 0),
    actor        text NOT NULL,
    reason       text NOT NULL CHECK (reason <> ''),
    git_sha      text NOT NULL,                          -- the active bundle when it was made
    granted_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX budget_grants_window ON budget_grants (policy_id, ledger_key, revision);

-- The first row of a batch carries the highest revision of overrides and grants together.
CREATE OR REPLACE FUNCTION budgetgate_begin_batch(p_run_ids text[])
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
               budgetgate_committed_ledger_seq(),
               GREATEST(COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0),
                        COALESCE((SELECT max(g.revision) FROM budget_grants g), 0))::bigint;
    RETURN QUERY
        SELECT d.run_id, d.decision_id, d.attempt, d.outcome, d.request, d.response, NULL::bigint, NULL::bigint
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT x.run_id, x.decision_id, x.attempt, x.outcome, x.request, x.response FROM decisions x
                            WHERE x.run_id = ids.id ORDER BY x.attempt DESC LIMIT 1) AS d
        ORDER BY d.run_id;
END
$$;
