-- Named queries of budgetgate.decisions (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: decisions_since
-- Recorded decisions from $1 on, in the order they were made, optionally only those with an
-- evaluation on scope (or policy id) $2 (replay, what-if); amounts as in decision_inputs.
SELECT d.decision_id, d.run_id, d.attempt, d.policy_bundle_sha, d.override_revision, d.request, d.response, d.decided_at, d.readings,
       (SELECT jsonb_object_agg(e.policy_id, jsonb_build_array(e.outcome, e.limit_amount, e.projected, e.remaining, e.admitted, e.deficit))
        FROM decision_evaluations e WHERE e.decision_id = d.decision_id AND e.decided_at = d.decided_at) AS amounts
FROM decisions d
WHERE d.decided_at >= $1
  AND ($2::text IS NULL OR EXISTS (SELECT 1 FROM decision_evaluations e
                                   WHERE e.decision_id = d.decision_id AND e.decided_at = d.decided_at AND (e.scope_id = $2 OR e.policy_id = $2)))
ORDER BY d.decided_at, d.ledger_seq NULLS FIRST, d.decision_id;

