-- Named queries of budgetgate.services.admission (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: begin_batch
-- The ledger lock of every shard $2 the batch touches, of the ledger's $3 (shared, in shard order;
-- 0044) + the lock of every run of a batch, all at session level (0036: let go by ledger_session
-- once the batch's write committed); then a row per shard with only the highest ledger sequence
-- Postgres committed of it and the highest tenant override revision, then each run's latest
-- decision (0033: with no outcome, request or response when it is archived): one round trip.
SELECT run_id, decision_id, attempt, outcome, request, response, committed_seq, override_revision, decided_at, shard
FROM budgetgate_begin_decisions($1::text[], $2::integer[], $3::integer);

-- name: record_decisions
-- A batch of decisions, each with its evaluations, its ledger entries and reservations (when it
-- reserved), its concurrency holds and pool token (when it holds any), in one statement. $1 is
-- a jsonb array of DecisionRecord (services/admission/records.py); $2..$6 are the outbox bundle
-- of their decision messages (topic, keys, payloads, event ids, shared headers), one row.
WITH batch AS (
    SELECT * FROM jsonb_to_recordset($1::jsonb) AS d(
        decision_id uuid, run_id text, attempt integer, outcome text, reason text, namespace text, labels jsonb,
        job_namespace text, job_name text, policy_bundle_sha text, projected_gpu bigint, showback_micros bigint,
        currency text, request jsonb, response jsonb, decided_at timestamptz, ledger_seq bigint, readings jsonb,
        override_revision bigint, gpus integer, nodes integer, flavor text, region text, expected_end timestamptz, evaluations jsonb,
        entries jsonb, reservations jsonb, holds jsonb, token jsonb, provisional boolean)
), decision AS (
    INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace,
                           job_name, policy_bundle_sha, projected_gpu, showback_micros, currency, request,
                           response, decided_at, ledger_seq, readings, override_revision, gpus, nodes, flavor, region)
    SELECT decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name,
           policy_bundle_sha, projected_gpu, showback_micros, currency, request, response, decided_at, ledger_seq,
           readings, override_revision, gpus, nodes, flavor, region
    FROM batch
), evaluations AS (
    INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, window_start,
                                      window_end, unit, enforcement, outcome, limit_amount, projected, remaining,
                                      admitted, deficit, next_eligible_time, decided_at)
    SELECT b.decision_id, e.*, b.decided_at
    FROM batch b, jsonb_to_recordset(b.evaluations) AS e(
        policy_id text, policy_git_sha text, scope_id text, ledger_key text, window_start timestamptz,
        window_end timestamptz, unit text, enforcement text, outcome text, limit_amount bigint, projected bigint,
        remaining bigint, admitted bigint, deficit bigint, next_eligible_time timestamptz)
), entries AS (
    INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id,
                                policy_git_sha, limit_amount)
    SELECT DISTINCT ON (l.ledger_key) l.ledger_key, l.scope_id, l.unit, l.window_key, l.window_start,
           l.window_end, l.policy_id, b.policy_bundle_sha, l.limit_amount
    FROM batch b, jsonb_to_recordset(b.entries) AS l(
        ledger_key text, scope_id text, unit text, window_key text, window_start timestamptz,
        window_end timestamptz, policy_id text, limit_amount bigint)
    ORDER BY l.ledger_key
    ON CONFLICT (ledger_key) DO NOTHING
), held AS (
    INSERT INTO reservations (run_id, ledger_key, decision_id, amount, expected_end)
    SELECT b.run_id, r.ledger_key, b.decision_id, r.amount, b.expected_end
    FROM batch b, jsonb_to_recordset(b.reservations) AS r(ledger_key text, amount bigint)
), concurrency AS (
    INSERT INTO run_holds (run_id, decision_id, tenant, gpus, nodes, sensitive)
    SELECT b.run_id, b.decision_id, b.holds ->> 'tenant', (b.holds ->> 'gpus')::integer,
           (b.holds ->> 'nodes')::integer, (b.holds ->> 'sensitive')::boolean
    FROM batch b WHERE b.holds IS NOT NULL AND b.holds <> 'null'::jsonb
), token AS (
    -- A row of the token left from before (released, or its lease run out: Redis found the token
    -- free) is the run's now; a live one of another holder is not taken over: reserve.lua
    -- refuses a submission whose token is held, so it never gets here.
    INSERT INTO pool_allocations AS a (namespace, token, levels, project, sub_namespace, run_id, lease_expires_at, lease_seconds)
    SELECT b.token ->> 'namespace', 'run:' || b.run_id, ARRAY(SELECT jsonb_array_elements_text(b.token -> 'levels')),
           b.token ->> 'project', b.token ->> 'sub_namespace', b.run_id, (b.token ->> 'lease_expires_at')::timestamptz,
           (b.token ->> 'lease_seconds')::integer
    FROM batch b WHERE b.token IS NOT NULL AND b.token <> 'null'::jsonb
    ON CONFLICT (namespace, token) DO UPDATE
    SET levels = EXCLUDED.levels, project = EXCLUDED.project, sub_namespace = EXCLUDED.sub_namespace, run_id = EXCLUDED.run_id,
        lease_expires_at = EXCLUDED.lease_expires_at, lease_seconds = EXCLUDED.lease_seconds, state = 'held', principal = NULL,
        granted_at = now(), released_at = NULL
    WHERE a.state = 'released' OR a.lease_expires_at <= clock_timestamp()
), provisional AS (
    -- An admission the Kubernetes validating webhook made before the API server stored the
    -- object: the reconciler gives it back unless a fact confirms the object (migration 0028).
    INSERT INTO provisional_holds (run_id, decision_id, held_since)
    SELECT b.run_id, b.decision_id, b.decided_at FROM batch b WHERE b.provisional AND b.outcome = 'ALLOW'
    ON CONFLICT (run_id) DO UPDATE SET decision_id = EXCLUDED.decision_id, held_since = EXCLUDED.held_since
)
INSERT INTO outbox (topic, headers, records, keys, payloads, event_ids)
VALUES ($2, $6::jsonb, cardinality($4::bytea[]), $3::text[], $4::bytea[], $5::text[]);

-- name: ensure_ledger_entries
-- Ledger entries of plans: a jsonb array of entries (see services/admission/records.py entry()).
-- Inserted in key order, as record_decisions does: two batches creating the same new keys (the
-- first submissions of a new window) in the orders their plans listed them each held a key the
-- other waited for, and deadlocked. Keys already there are skipped before inserting, so a key
-- whose row another transaction is changing is not waited for.
INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id,
                            policy_git_sha, limit_amount)
SELECT l.ledger_key, l.scope_id, l.unit, l.window_key, l.window_start, l.window_end, l.policy_id, l.policy_git_sha,
       l.limit_amount
FROM jsonb_to_recordset($1::jsonb) AS l(ledger_key text, scope_id text, unit text, window_key text,
                                        window_start timestamptz, window_end timestamptz, policy_id text,
                                        policy_git_sha text, limit_amount bigint)
WHERE NOT EXISTS (SELECT 1 FROM ledger_entries e WHERE e.ledger_key = l.ledger_key)
ORDER BY l.ledger_key
ON CONFLICT (ledger_key) DO NOTHING;

-- name: fair_share_usages
SELECT tenant, decayed_gpu, reckoned_at, half_life_seconds FROM fair_share_usage;

-- name: upsert_pool_allocation
-- Granted or renewed: a renewal extends the lease of the same (namespace, token). $8 is the
-- principal that holds it.
INSERT INTO pool_allocations (namespace, token, levels, project, sub_namespace, run_id, lease_expires_at, principal)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (namespace, token) DO UPDATE
SET lease_expires_at = EXCLUDED.lease_expires_at, state = 'held', released_at = NULL, levels = EXCLUDED.levels, principal = EXCLUDED.principal,
    project = EXCLUDED.project, sub_namespace = EXCLUDED.sub_namespace, granted_at = CASE
        WHEN pool_allocations.state = 'held' THEN pool_allocations.granted_at ELSE now() END;

-- name: release_pool_allocation
UPDATE pool_allocations SET state = 'released', released_at = now()
WHERE namespace = $1 AND token = $2 AND state = 'held' RETURNING levels;

-- name: pool_allocation_principal
-- The row of a held token: who holds it (NULL: granted with a submission, or before tokens had
-- holders), and for which project and sub-namespace.
SELECT principal, project, sub_namespace FROM pool_allocations WHERE namespace = $1 AND token = $2 AND state = 'held' AND lease_expires_at > now();

-- name: lock_pool_token
-- Serialises the allocations of one token of one pool, across processes: what its row says is
-- still so when Redis is asked and the row written.
SELECT pg_advisory_xact_lock(7340, hashtext($1 || chr(9) || $2));

-- name: record_admitted_object
-- A Kubernetes object let through on a decision (its own, or its owner's): its children may be
-- let through on it.
INSERT INTO admitted_objects (uid, namespace, kind, name, run_id) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (uid) DO NOTHING;

-- name: admitted_owner
-- The run an owner was let through for: the object of that UID, namespace and kind the webhook
-- recorded; or, for an owner admitted before the webhook recorded them (migration 0022), a
-- decision made before then on that namespace and name under the owner's UID as run id. A UID
-- alone is no proof: an ownerReference is its creator's to write, and could name an admitted
-- object of another kind or namespace.
SELECT o.run_id FROM admitted_objects o WHERE o.uid = $1 AND o.namespace = $2 AND o.kind = $3
UNION ALL
SELECT d.run_id FROM decisions d
WHERE d.run_id = $1 AND d.outcome = 'ALLOW' AND d.job_namespace = $2 AND d.job_name = $4
  AND d.decided_at < (SELECT m.applied_at FROM schema_migrations m WHERE m.name = '0022_admitted_objects')
LIMIT 1;


-- name: held_run_tokens
-- The pool tokens of runs ($1: run:<run id> each) held with a live lease, and the levels they
-- are held on: a token taken apart on a ledger of several shards (Admitter._take_tokens) is
-- refused as taken while an earlier attempt of its run holds it on a level asked.
SELECT token, levels FROM pool_allocations WHERE token = ANY($1::text[]) AND state = 'held' AND lease_expires_at > now();

-- name: holds_own_token
-- Whether run $2 holds token $1 (run:<run id>) itself: a quote of it on a ledger of several shards
-- reads the token as its own, not as taken (Quoter._check_token).
SELECT EXISTS (SELECT 1 FROM pool_allocations WHERE token = $1 AND run_id = $2 AND state = 'held' AND lease_expires_at > now());
