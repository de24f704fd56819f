-- Named queries of budgetgate.reports (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: scope_figures
SELECT e.ledger_key, e.policy_id, e.policy_git_sha, e.unit, e.window_start, e.window_end, e.limit_amount,
       e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- inbox (libs/budgetgate/messaging/inbox.py) ---------------------------------------------------------

-- name: labelled_runs
-- The runs labelled $1 = $2 (a tenant's, a user's): how many, GPU-hours held by reservations
-- not yet replaced by actuals, and GPU/node-hours metered since $3.
WITH runs AS (
    SELECT DISTINCT ON (d.run_id) d.run_id, d.outcome, d.projected_gpu
    FROM decisions d WHERE d.labels ->> $1 = $2 ORDER BY d.run_id, d.attempt DESC
), metered AS (
    SELECT s.run_id, max(s.gpu) AS gpu, COALESCE(max(s.gpu) FILTER (WHERE s.observed_at < $3), 0) AS gpu_before,
           max(s.node) AS node, COALESCE(max(s.node) FILTER (WHERE s.observed_at < $3), 0) AS node_before
    FROM run_samples s JOIN runs USING (run_id) GROUP BY s.run_id
), holding AS (
    SELECT DISTINCT r.run_id FROM reservations r JOIN runs USING (run_id) WHERE r.state = 'held'
)
SELECT count(*)::bigint AS runs,
       count(*) FILTER (WHERE runs.outcome = 'ALLOW')::bigint AS admitted,
       COALESCE(SUM(GREATEST(runs.projected_gpu - COALESCE(m.gpu, 0), 0)) FILTER (WHERE h.run_id IS NOT NULL), 0)::bigint AS reserved_gpu,
       COALESCE(SUM(m.gpu - m.gpu_before), 0)::bigint AS consumed_gpu,
       COALESCE(SUM(m.node - m.node_before), 0)::bigint AS consumed_node
FROM runs LEFT JOIN metered m USING (run_id) LEFT JOIN holding h USING (run_id);

-- evidence-emitter ------------------------------------------------------------------------------

-- name: budget_figures
-- Reserved, consumed and whether a hold is in force, for each ledger key of $1 (keys without a
-- ledger entry yet read as nothing used): one round trip for every budget of a bundle.
SELECT k.ledger_key, COALESCE(e.consumed, 0)::bigint AS consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = k.ledger_key AND r.state = 'held'), 0)::bigint AS reserved,
       EXISTS (SELECT 1 FROM budget_holds h WHERE h.ledger_key = k.ledger_key) AS held
FROM unnest($1::text[]) AS k (ledger_key) LEFT JOIN ledger_entries e USING (ledger_key);

-- name: whatif_decision_count
-- How many decisions were recorded from $1 on (what policy what-if's progress counts to).
SELECT count(*) FROM decisions WHERE decided_at >= $1;

-- name: whatif_decisions
-- The submissions recorded from $1 on, in the order decided, with what history decided and why,
-- the ledger readings each was decided on, and its evaluations' distinct "enforcement outcome"
-- pairs (what its budgets alone decided; NULL when the answer recorded none, `?` for a part an
-- evaluation lacks) (policy what-if).
SELECT run_id, attempt, outcome, reason, request, decided_at, readings -> 'ledger' AS ledger,
       CASE WHEN jsonb_typeof(response -> 'evaluations') = 'array' THEN ARRAY(
           SELECT DISTINCT coalesce(e ->> 'enforcement', '?') || ' ' || coalesce(e ->> 'decision', '?') FROM jsonb_array_elements(response -> 'evaluations') AS e
       ) END AS verdicts
FROM decisions WHERE decided_at >= $1
ORDER BY decided_at, ledger_seq NULLS FIRST, decision_id;

-- name: whatif_ends
-- Runs whose end was recorded from $1 on: their metered GPU use, or released unused (a run
-- that never started has no end of its own: its release counts from when it was settled).
SELECT run_id, COALESCE(ended_at, settled_at) AS ended_at, actual_gpu, released
FROM run_settlements WHERE (final OR released) AND COALESCE(ended_at, settled_at) >= $1;

-- name: whatif_holds
-- Reservations held at instant $1 by runs decided before it: amount per ledger key.
SELECT r.run_id, d.projected_gpu, jsonb_object_agg(r.ledger_key, r.amount) AS amounts
FROM reservations r JOIN decisions d ON d.decision_id = r.decision_id
WHERE d.decided_at < $1 AND r.created_at < $1 AND (r.ended_at IS NULL OR r.ended_at >= $1)
GROUP BY r.run_id, d.projected_gpu;

-- name: whatif_lease_figures
-- The escrow leases of the budgets filed under $1 (their own ledger keys), with their figures now.
SELECT l.lease_key, e.consumed, clock_timestamp() AS read_at,
       COALESCE((SELECT sum(r.amount) FROM reservations r WHERE r.ledger_key = l.lease_key AND r.state = 'held'), 0)::bigint AS reserved
FROM escrow_leases l JOIN ledger_entries e ON e.ledger_key = l.lease_key
WHERE l.ledger_key = ANY($1::text[]);

-- authenticated callers


-- chargeback (budgetgate.reports.chargeback) ----------------------------------------------------

-- name: chargeback_metered
-- Metered GPU and node milli-hours with observed_at in [$1, $2), at the finest grain a report
-- rolls up from: the run's namespace, tenant ($4 label) and user ($5 label), flavor and region
-- (its latest admitted decision), the budgets it reserved on, the UTC day, and the rate segment
-- ($3: the instants a rate takes effect, ascending; the segment is how many are not after the
-- sample). Each sample counts by how much it raised its run's high-water mark (the delta). A UTC
-- day is date_bin's (fixed 24 h bins from a UTC midnight): date_trunc with a time zone costs twice
-- as much per record. Runs are materialized so each run's budgets are read once. With $6 (a report
-- by account) the run's labels are part of the grain too, for the account tree to place it.
WITH used AS (
    SELECT u.run_id, date_bin('1 day', u.observed_at, timestamptz '2000-01-01Z') AS day,
           width_bucket(u.observed_at, $3::timestamptz[]) AS segment,
           sum(u.gpu_milli_hours_delta)::bigint AS gpu, sum(u.node_milli_hours_delta)::bigint AS node, min(u.observed_at) AS first_at
    FROM usage_records u WHERE u.observed_at >= $1 AND u.observed_at < $2
    GROUP BY 1, 2, 3
), runs AS MATERIALIZED (
    SELECT r.run_id, d.namespace, d.labels ->> $4 AS tenant, d.labels ->> $5 AS user_value, d.flavor, d.region,
           ARRAY(SELECT DISTINCT e.policy_id FROM reservations x JOIN ledger_entries e USING (ledger_key)
                 WHERE x.run_id = r.run_id ORDER BY 1) AS budgets,
           CASE WHEN $6::boolean THEN d.labels END AS labels
    FROM (SELECT DISTINCT run_id FROM used) AS r
    CROSS JOIN LATERAL (SELECT x.namespace, x.labels, x.flavor, x.region FROM decisions x WHERE x.run_id = r.run_id
                        ORDER BY x.outcome = 'ALLOW' DESC, x.attempt DESC LIMIT 1) AS d
)
SELECT runs.namespace, runs.tenant, runs.user_value, runs.flavor, runs.region, runs.budgets, used.day, used.segment, runs.labels,
       sum(used.gpu)::bigint AS gpu, sum(used.node)::bigint AS node, min(used.first_at) AS priced_at
FROM used JOIN runs USING (run_id)
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9;

-- name: chargeback_reserved
-- GPU milli-hours still reserved (held) and not yet metered, of runs decided in [$1, $2): the
-- projection less the run's metered high-water mark, never below nothing; at the grain of
-- chargeback_metered, dated by the decision that holds them.
WITH held AS (
    SELECT DISTINCT ON (r.run_id) r.run_id, r.decision_id FROM reservations r WHERE r.state = 'held' ORDER BY r.run_id, r.created_at DESC
)
SELECT d.namespace, d.labels ->> $4 AS tenant, d.labels ->> $5 AS user_value, d.flavor, d.region,
       ARRAY(SELECT DISTINCT e.policy_id FROM reservations x JOIN ledger_entries e USING (ledger_key)
             WHERE x.run_id = held.run_id ORDER BY 1) AS budgets,
       date_bin('1 day', d.decided_at, timestamptz '2000-01-01Z') AS day, width_bucket(d.decided_at, $3::timestamptz[]) AS segment,
       CASE WHEN $6::boolean THEN d.labels END AS labels,
       sum(GREATEST(d.projected_gpu - COALESCE(u.gpu_milli_hours_cumulative, 0), 0))::bigint AS gpu, min(d.decided_at) AS priced_at
FROM held JOIN decisions d ON d.decision_id = held.decision_id LEFT JOIN usage_runs u ON u.run_id = held.run_id
WHERE d.decided_at >= $1 AND d.decided_at < $2
GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9;

-- name: budget_daily_usage
-- Metered GPU and node milli-hours by UTC day (date_bin's fixed 24 h bins) of the runs that
-- reserved on each ledger key of $1, observed within that key's window [$2, $3) (the arrays run
-- in step): the daily curve of a budget's burn-down. Each sample counts by how much it raised its
-- run's high-water mark, as in chargeback_metered.
WITH k AS (
    SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[]) AS k (ledger_key, start_at, end_at)
)
SELECT k.ledger_key, date_bin('1 day', u.observed_at, timestamptz '2000-01-01Z') AS day,
       sum(u.gpu_milli_hours_delta)::bigint AS gpu, sum(u.node_milli_hours_delta)::bigint AS node
FROM k JOIN reservations r ON r.ledger_key = k.ledger_key
JOIN usage_records u ON u.run_id = r.run_id AND u.observed_at >= k.start_at AND u.observed_at < k.end_at
GROUP BY 1, 2 ORDER BY 1, 2;

-- name: recent_decisions
-- Decisions newest first, before the keyset ($1 decided_at, $2 decision_id; NULLs: from the
-- newest), of the tenants in $4 by the $5 label (NULL: any tenant), $3 at most.
SELECT d.decision_id, d.run_id, d.attempt, d.outcome, d.reason, d.namespace, d.labels ->> $5 AS tenant, d.decided_at,
       d.projected_gpu, d.policy_bundle_sha
FROM decisions d
WHERE ($1::timestamptz IS NULL OR (d.decided_at, d.decision_id) < ($1, $2::uuid))
  AND ($4::text[] IS NULL OR d.labels ->> $5 = ANY ($4::text[]))
ORDER BY d.decided_at DESC, d.decision_id DESC
LIMIT $3;
