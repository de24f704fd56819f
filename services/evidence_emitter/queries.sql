-- Named queries of budgetgate.services.evidence_emitter (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: evidence_try_lead
-- One sender at a time (session lock, dropped with its connection), so events go out in order.
SELECT pg_try_advisory_lock(7305, 0);

-- name: evidence_unlead
SELECT pg_advisory_unlock(7305, 0);

