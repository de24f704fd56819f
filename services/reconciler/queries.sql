-- Named queries of budgetgate.services.reconciler (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: prune_ledger_marks
-- Only the highest mark of each shard's residue counts (budgetgate_committed_ledger_seq, 0043);
-- the others go.
DELETE FROM ledger_marks m WHERE m.ledger_seq < (SELECT max(x.ledger_seq) FROM ledger_marks x WHERE x.ledger_seq % 64 = m.ledger_seq % 64);

-- name: record_lifecycle_batch
-- Lifecycle events as reported; returns the runs of the events that were new.
INSERT INTO lifecycle_events (event_id, run_id, kind, event_time, gpus, nodes, flavor, reason)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::integer[], $6::integer[], $7::text[], $8::text[])
ON CONFLICT (event_id) DO NOTHING RETURNING run_id;

-- name: record_samples
-- Usage samples; returns the runs of the samples that were new (a sample id seen before is not).
INSERT INTO run_samples (run_id, sample_id, observed_at, gpu, node)
SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::bigint[])
ON CONFLICT (run_id, sample_id) DO NOTHING RETURNING run_id;

-- name: mark_runs_to_settle
-- Sorted run ids, so two consumers marking overlapping runs lock them in the same order.
-- A mark already there is locked, not skipped (DO UPDATE ... WHERE false writes nothing but
-- locks the row): a settlement taking it away (unmark_settled) then waits for this transaction
-- to commit, and so reads the facts it records. Skipped, it was taken away while these facts
-- were not yet visible, and they stayed unsettled with no mark left to say so.
INSERT INTO runs_to_settle (run_id) SELECT unnest($1::text[])
ON CONFLICT (run_id) DO UPDATE SET since = runs_to_settle.since WHERE false;

-- name: runs_waiting
-- Dead-lettered runs wait for an operator, not for the next loop.
SELECT w.run_id FROM runs_to_settle w
WHERE NOT EXISTS (SELECT 1 FROM settlement_failures f WHERE f.run_id = w.run_id AND f.dead)
ORDER BY w.since LIMIT $1;

-- name: unmark_settled
-- Before the run's facts are read: a transaction marking the run holds its mark (see
-- mark_runs_to_settle) and this waits for its commit; one marking it after this finds no mark
-- and leaves a new one.
DELETE FROM runs_to_settle WHERE run_id = $1;

-- name: runs_due
-- Runs whose charges change with time alone (wall time, grace, deadline) by $1.
SELECT s.run_id FROM run_settlements s WHERE s.review_at <= $1
  AND NOT EXISTS (SELECT 1 FROM settlement_failures f WHERE f.run_id = s.run_id AND f.dead)
ORDER BY s.review_at LIMIT $2;

-- name: unseen_holds
-- Runs the reconciler never settled, holding since before $1 (the start deadline) a reservation,
-- a concurrency hold or a pool token: settled so that the never-started rule (or a fact settled
-- before the decision committed) gives them back. A run no budget covers holds no reservation,
-- only its quota slot or its token, so those are looked for too. A dead-lettered one waits for an
-- operator (`budgetgate settlements resolve`), as runs_due's do: tried every tick, it was
-- logged again each time and its dead letter's times moved.
SELECT DISTINCT h.run_id FROM (
    SELECT r.run_id FROM reservations r WHERE r.state = 'held' AND r.created_at <= $1
    UNION ALL
    SELECT c.run_id FROM run_holds c WHERE c.state = 'held' AND c.created_at <= $1
    UNION ALL
    SELECT a.run_id FROM pool_allocations a WHERE a.run_id IS NOT NULL AND a.state = 'held' AND a.granted_at <= $1
) AS h
WHERE NOT EXISTS (SELECT 1 FROM run_settlements s WHERE s.run_id = h.run_id)
  AND NOT EXISTS (SELECT 1 FROM settlement_failures f WHERE f.run_id = h.run_id AND f.dead)
LIMIT $2;

-- name: run_decision
-- The decision that admitted the run (a DELAYed run may have been admitted on a later attempt),
-- the tenant its concurrency holds were taken for, whether an earlier attempt was refused, and
-- the latest observation of a sample metering-ingest accepted for it (usage_runs, its table:
-- usage that may not have reached this reconciler yet, see RunFacts.metered_through).
SELECT d.decision_id, d.decided_at, d.policy_bundle_sha, d.projected_gpu, d.gpus, d.nodes, d.flavor, d.region, d.labels,
       d.job_namespace, d.job_name, (SELECT h.tenant FROM run_holds h WHERE h.run_id = d.run_id) AS tenant,
       (SELECT u.latest_observed_at FROM usage_runs u WHERE u.run_id = d.run_id) AS metered_through,
       EXISTS (SELECT 1 FROM decisions r WHERE r.run_id = d.run_id AND r.attempt < d.attempt AND r.outcome <> 'ALLOW') AS after_refusal,
       EXISTS (SELECT 1 FROM provisional_holds p WHERE p.run_id = d.run_id AND p.decision_id = d.decision_id) AS provisional
FROM decisions d WHERE d.run_id = $1 AND d.outcome = 'ALLOW' ORDER BY d.attempt DESC LIMIT 1;

-- name: run_root
-- The root of run $1 on a sharded ledger: its tenant, the value of label $2 of its latest
-- admission (budgetgate.core.shards.run_root).
SELECT d.labels ->> $2 FROM decisions d WHERE d.run_id = $1 AND d.outcome = 'ALLOW' ORDER BY d.attempt DESC LIMIT 1;

-- name: unconfirmed_holds
-- Provisional admissions (the Kubernetes webhook's) held since before $1 (the provisional hold)
-- whose row is still there: settled so that one no fact confirmed is given back. A dead-lettered
-- one waits for an operator, as unseen_holds's do.
SELECT p.run_id FROM provisional_holds p
WHERE p.held_since <= $1
  AND NOT EXISTS (SELECT 1 FROM settlement_failures f WHERE f.run_id = p.run_id AND f.dead)
ORDER BY p.held_since LIMIT $2;

-- name: end_provisional_hold
-- The run's provisional hold of decision $2 was confirmed, given back or ended.
DELETE FROM provisional_holds WHERE run_id = $1 AND decision_id = $2;

-- name: forget_provisional_holds
-- A run without an admitting decision holds nothing provisionally.
DELETE FROM provisional_holds WHERE run_id = $1;

-- name: run_reservations
SELECT r.ledger_key, r.amount, r.state, e.policy_id, e.admitted
FROM reservations r JOIN decision_evaluations e ON e.decision_id = r.decision_id AND e.ledger_key = r.ledger_key
WHERE r.run_id = $1 AND r.decision_id = $2;

-- name: run_lifecycle
SELECT event_id, kind, event_time, gpus, nodes FROM lifecycle_events WHERE run_id = $1;

-- name: run_sample_rows
SELECT sample_id, observed_at, gpu, node FROM run_samples WHERE run_id = $1;

-- name: run_meter
SELECT gpu, node, covered, last_at, last_id, used, timed FROM run_meters WHERE run_id = $1;

-- name: put_run_meter
INSERT INTO run_meters (run_id, gpu, node, covered, last_at, last_id, used, timed)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb)
ON CONFLICT (run_id) DO UPDATE SET gpu = EXCLUDED.gpu, node = EXCLUDED.node, covered = EXCLUDED.covered,
    last_at = EXCLUDED.last_at, last_id = EXCLUDED.last_id, used = EXCLUDED.used, timed = EXCLUDED.timed;

-- name: reset_run_meter
-- Repair: forget the run's folded state, so its next settlement folds its whole history again.
WITH gone AS (DELETE FROM run_meters WHERE run_id = $1)
UPDATE run_samples SET gpu_high = NULL, node_high = NULL WHERE run_id = $1;

-- name: unfolded_samples
SELECT sample_id, observed_at, gpu, node FROM run_samples WHERE run_id = $1 AND gpu_high IS NULL
ORDER BY observed_at, sample_id COLLATE "C";

-- name: sample_before
-- The folded sample just before (observed_at, sample_id) = ($2, $3) on the run's line.
SELECT gpu_high, node_high FROM run_samples
WHERE run_id = $1 AND gpu_high IS NOT NULL AND (observed_at, sample_id COLLATE "C") < ($2, $3 COLLATE "C")
ORDER BY observed_at DESC, sample_id COLLATE "C" DESC LIMIT 1;

-- name: samples_after
SELECT sample_id, observed_at, gpu, node, gpu_high, node_high FROM run_samples
WHERE run_id = $1 AND gpu_high IS NOT NULL AND (observed_at, sample_id COLLATE "C") > ($2, $3 COLLATE "C")
ORDER BY observed_at, sample_id COLLATE "C" LIMIT $4;

-- name: put_sample_highs
UPDATE run_samples s SET gpu_high = h.gpu_high, node_high = h.node_high
FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS h(sample_id, gpu_high, node_high)
WHERE s.run_id = $1 AND s.sample_id = h.sample_id;

-- name: run_charges_at
SELECT c.ledger_key, c.bucket, c.amount FROM run_charges c
JOIN unnest($2::text[], $3::timestamptz[]) AS t(ledger_key, bucket) ON c.ledger_key = t.ledger_key AND c.bucket = t.bucket
WHERE c.run_id = $1;

-- name: record_settlement_failure
-- One more failed try; dead once $3 tries have failed.
INSERT INTO settlement_failures (run_id, reason, dead) VALUES ($1, $2, $3 <= 1)
ON CONFLICT (run_id) DO UPDATE SET attempts = settlement_failures.attempts + 1, reason = EXCLUDED.reason,
    last_failed_at = now(), dead = settlement_failures.attempts + 1 >= $3
RETURNING attempts, dead;

-- name: clear_settlement_failures
-- Runs settled now ($1): their earlier failed tries no longer count towards dead-lettering.
DELETE FROM settlement_failures WHERE run_id = ANY($1::text[]) AND NOT dead;

-- name: dead_settlements
-- Dead-lettered settlements (services/reconciler/dead_letters.py), longest dead first, $1 at most.
SELECT run_id, reason, attempts, first_failed_at, last_failed_at FROM settlement_failures WHERE dead
ORDER BY last_failed_at, run_id LIMIT $1;

-- name: dead_settlements_count
SELECT count(*) FROM settlement_failures WHERE dead;

-- name: dead_settlement
-- Run $1's dead-lettered settlement, locked until the transaction resolving it ends.
SELECT run_id, reason, attempts, first_failed_at, last_failed_at FROM settlement_failures WHERE run_id = $1 AND dead FOR UPDATE;

-- name: forget_dead_settlement
-- Resolved by an operator: the run's next fact is settled as any run's.
DELETE FROM settlement_failures WHERE run_id = $1 AND dead;

-- name: runs_holding
-- What runs $1 hold now: their held reservations, each with its budget (policy, scope, window and
-- unit; amounts in the ledger's units), their quota hold, and their pool tokens (namespace/token).
SELECT x.run_id,
       COALESCE((SELECT jsonb_agg(jsonb_build_object('ledger_key', r.ledger_key, 'ledger_amount', r.amount, 'policy_id', e.policy_id,
                                                     'scope_id', e.scope_id, 'window_key', e.window_key, 'unit', e.unit) ORDER BY r.ledger_key)
                 FROM reservations r JOIN ledger_entries e ON e.ledger_key = r.ledger_key
                 WHERE r.run_id = x.run_id AND r.state = 'held'), '[]'::jsonb) AS reservations,
       h.tenant, h.gpus, h.nodes,
       ARRAY(SELECT a.namespace || '/' || a.token FROM pool_allocations a
             WHERE a.run_id = x.run_id AND a.state = 'held' AND a.lease_expires_at > now() ORDER BY 1) AS tokens
FROM unnest($1::text[]) AS x (run_id) LEFT JOIN run_holds h ON h.run_id = x.run_id AND h.state = 'held';

-- name: try_lock_run
-- The run's lock (lock_run) if free: a settlement in flight keeps it.
SELECT pg_try_advisory_xact_lock(7302, hashtext($1));

-- name: run_revision
SELECT revision FROM run_settlements WHERE run_id = $1;

-- name: run_settlement
SELECT run_id, phase, released, final, provisional, wall, review_at, revision, actual_gpu FROM run_settlements WHERE run_id = $1;

-- name: entry_figures
-- size: an escrow lease's (migration 0041), NULL for any other key.
SELECT e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved,
       (SELECT l.size FROM escrow_leases l WHERE l.lease_key = e.ledger_key) AS size
FROM ledger_entries e WHERE e.ledger_key = $1;

-- name: run_charge_rows
SELECT ledger_key, bucket, amount FROM run_charges WHERE run_id = $1;

-- name: put_run_charges
INSERT INTO run_charges (run_id, ledger_key, bucket, amount)
SELECT $1, c.ledger_key, c.bucket, c.amount FROM unnest($2::text[], $3::timestamptz[], $4::bigint[]) AS c(ledger_key, bucket, amount)
ON CONFLICT (run_id, ledger_key, bucket) DO UPDATE SET amount = EXCLUDED.amount;

-- name: drop_run_charges
DELETE FROM run_charges c USING unnest($2::text[], $3::timestamptz[]) AS d(ledger_key, bucket)
WHERE c.run_id = $1 AND c.ledger_key = d.ledger_key AND c.bucket = d.bucket;

-- name: set_held
-- What the run holds on each reserved key now; $4 closes the reservations ('reconciled' when
-- replaced by actuals, 'released' when given back unused, NULL while the run goes on).
UPDATE reservations r
SET amount = h.amount,
    state = COALESCE($4, r.state),
    ended_at = CASE WHEN $4 IS NULL THEN r.ended_at ELSE now() END,
    end_reason = CASE WHEN $4 IS NULL THEN r.end_reason ELSE $5 END
FROM unnest($2::text[], $3::bigint[]) AS h(ledger_key, amount)
WHERE r.run_id = $1 AND r.ledger_key = h.ledger_key AND r.state = 'held';

-- name: put_settlement
INSERT INTO run_settlements (run_id, decision_id, phase, final, provisional, released, over_running, final_state,
                             ended_at, wall, projected_gpu, actual_gpu, error_gpu, review_at, revision, settled_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 1, clock_timestamp())
ON CONFLICT (run_id) DO UPDATE SET
    decision_id = EXCLUDED.decision_id, phase = EXCLUDED.phase, final = EXCLUDED.final,
    provisional = EXCLUDED.provisional, released = EXCLUDED.released, over_running = EXCLUDED.over_running,
    final_state = EXCLUDED.final_state, ended_at = EXCLUDED.ended_at, wall = EXCLUDED.wall,
    projected_gpu = EXCLUDED.projected_gpu, actual_gpu = EXCLUDED.actual_gpu, error_gpu = EXCLUDED.error_gpu,
    review_at = EXCLUDED.review_at, revision = run_settlements.revision + 1, settled_at = clock_timestamp()
RETURNING revision;

-- name: entry_exists
SELECT ledger_key FROM ledger_entries WHERE ledger_key = ANY($1::text[]);

-- name: create_entry
-- A window's ledger entry the first time usage lands in it (admission creates the others), at
-- the limit a tenant override sets for the policy, else $9 (the bundle's), plus the window's grants
-- (migration 0031), never below zero.
INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id,
                            policy_git_sha, limit_amount)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, GREATEST(0, COALESCE(
    (SELECT (s.value ->> 'amount')::bigint FROM tenant_overrides_current o, jsonb_each(o.settings) s
     WHERE s.value ->> 'policy_id' = $7 AND s.value ->> 'unit' = $3 LIMIT 1), $9)
    + COALESCE((SELECT sum(g.amount) FROM budget_grants g WHERE g.policy_id = $7 AND g.ledger_key = $1), 0)))
ON CONFLICT (ledger_key) DO NOTHING;

-- name: add_consumed
-- Rows locked in key order first, so two settlements never wait on each other in a cycle.
WITH locked AS (
    SELECT e.ledger_key FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[])
    ORDER BY e.ledger_key FOR NO KEY UPDATE
)
UPDATE ledger_entries e SET consumed = e.consumed + u.delta, updated_at = now()
FROM unnest($1::text[], $2::bigint[]) AS u(ledger_key, delta), locked l
WHERE e.ledger_key = u.ledger_key AND l.ledger_key = u.ledger_key
RETURNING e.ledger_key, e.consumed, e.limit_amount, e.policy_id, e.scope_id, e.window_end;

-- name: ensure_rolling_ages
INSERT INTO rolling_ages (ledger_key, rolling_days, aged_through)
SELECT a.ledger_key, a.days, a.through FROM unnest($1::text[], $2::integer[], $3::timestamptz[]) AS a(ledger_key, days, through)
ON CONFLICT (ledger_key) DO NOTHING;

-- name: rolling_ages_shared
-- Where rolling keys have aged to; FOR SHARE so ageing waits for this settlement, and back.
SELECT ledger_key, aged_through FROM rolling_ages WHERE ledger_key = ANY($1::text[]) ORDER BY ledger_key FOR SHARE;

-- name: rolling_keys
SELECT ledger_key, rolling_days, aged_through FROM rolling_ages ORDER BY ledger_key;

-- name: lock_rolling_age
SELECT rolling_days, aged_through FROM rolling_ages WHERE ledger_key = $1 FOR UPDATE;

-- name: charges_between
SELECT COALESCE(SUM(amount), 0)::bigint FROM run_charges WHERE ledger_key = $1 AND bucket >= $2 AND bucket < $3;

-- name: set_aged_through
UPDATE rolling_ages SET aged_through = $2 WHERE ledger_key = $1;

-- name: insert_alert
-- $2: the measure (committed, consumed), $3: the threshold in percent; true when not sent before.
INSERT INTO budget_alerts (ledger_key, measure, threshold_percent) VALUES ($1, $2, $3)
ON CONFLICT (ledger_key, measure, threshold_percent) DO NOTHING RETURNING true;

-- name: rearm_alerts
-- A rolling window whose usage aged out below a threshold may cross it again: each measure
-- ($2: consumed now, plus the held reservations for committed) against $3, the limit.
DELETE FROM budget_alerts a WHERE a.ledger_key = $1 AND a.threshold_percent::numeric * $3 > 100 * (
    $2::numeric + CASE WHEN a.measure = 'committed' THEN
        COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = $1 AND r.state = 'held'), 0) ELSE 0 END);

-- name: committed_alerts_due
-- The ledger entries of current windows whose committed (consumed + held reservations, as
-- `budgetgate budgets` reads it) has reached a threshold of $1 not alerted on yet ($2: now).
SELECT e.ledger_key, e.policy_id, e.scope_id, e.limit_amount, t.threshold,
       e.consumed + COALESCE(r.reserved, 0) AS committed
FROM ledger_entries e
LEFT JOIN LATERAL (SELECT SUM(amount) AS reserved FROM reservations
                   WHERE ledger_key = e.ledger_key AND state = 'held') r ON true
CROSS JOIN unnest($1::int[]) AS t (threshold)
WHERE e.limit_amount > 0 AND (e.window_end IS NULL OR e.window_end > $2)
  AND (e.consumed + COALESCE(r.reserved, 0))::numeric * 100 >= t.threshold::numeric * e.limit_amount
  AND NOT EXISTS (SELECT 1 FROM budget_alerts a
                  WHERE a.ledger_key = e.ledger_key AND a.measure = 'committed' AND a.threshold_percent = t.threshold)
ORDER BY e.ledger_key, t.threshold;

-- name: insert_hold
INSERT INTO budget_holds (ledger_key, policy_id, scope_id, on_exhausted) VALUES ($1, $2, $3, $4)
ON CONFLICT (ledger_key) DO NOTHING RETURNING true;

-- name: lock_active_holds
-- The holds in force, each locked with its ledger entry, as they are now: a hold another
-- reconciler is lifting, or whose entry a settlement is changing (it may exhaust the budget
-- again), is skipped, and looked at again on the next tick.
SELECT h.ledger_key, h.policy_id, h.scope_id, h.on_exhausted, e.consumed, e.limit_amount, e.window_end
FROM budget_holds h JOIN ledger_entries e USING (ledger_key) ORDER BY h.ledger_key
FOR UPDATE OF h SKIP LOCKED
FOR SHARE OF e SKIP LOCKED;

-- name: lift_hold
DELETE FROM budget_holds WHERE ledger_key = $1 RETURNING policy_id, scope_id;

-- name: running_under_policy
-- Running workloads a budget covers: those a hold-and-drain asks the platform to drain (charged
-- on it: a soft policy whose labels a run lacked is recorded on its decision, never charged).
SELECT s.run_id FROM run_settlements s JOIN decision_evaluations e ON e.decision_id = s.decision_id
WHERE e.policy_id = $1 AND e.ledger_key IS NOT NULL AND s.phase = 'running' ORDER BY s.run_id;

-- name: lock_fair_share_usage
-- A tenant's decayed usage, its row created (empty) when new and locked until the commit.
INSERT INTO fair_share_usage (tenant, decayed_gpu, reckoned_at, half_life_seconds) VALUES ($1, 0, $2, $3)
ON CONFLICT (tenant) DO UPDATE SET tenant = EXCLUDED.tenant
RETURNING decayed_gpu, reckoned_at, half_life_seconds;

-- name: put_fair_share_usage
UPDATE fair_share_usage SET decayed_gpu = $2, reckoned_at = $3, half_life_seconds = $4, updated_at = now() WHERE tenant = $1;

-- name: lock_headroom
-- The judgment locks ($1: names of tenants, the sensitive pool, budgets), all at once, in one
-- order, held to the end of the transaction (services/reconciler/headroom.py).
SELECT count(pg_advisory_xact_lock(7330, k.h)) FROM (SELECT DISTINCT hashtext(n) AS h FROM unnest($1::text[]) AS n ORDER BY 1) AS k;

-- name: forget_waiting
-- Runs decided again ($1 run ids, $2 the attempts decided): waiting no more at those attempts
-- or before, and the notices of those waits.
WITH gone AS (
    DELETE FROM waiting_runs w USING unnest($1::text[], $2::integer[]) AS x(run_id, attempt)
    WHERE w.run_id = x.run_id AND w.attempt <= x.attempt RETURNING w.decision_id
)
DELETE FROM headroom_notices n USING gone WHERE n.decision_id = gone.decision_id;

-- name: register_waiting
-- Runs refused for now, a jsonb array of waiting runs (services/reconciler/headroom.py); a run
-- decided again since (Postgres has a later attempt) is not registered. Returns those that were.
INSERT INTO waiting_runs (run_id, attempt, decision_id, waiting_for, tenant, labels, sensitive, gpus, nodes, needs, policy_ids,
                          checked_sha, decided_at)
SELECT w.run_id, w.attempt, w.decision_id, w.waiting_for, w.tenant, w.labels, w.sensitive, w.gpus, w.nodes, w.needs,
       ARRAY(SELECT jsonb_array_elements(w.needs) ->> 0), w.checked_sha, w.decided_at
FROM jsonb_to_recordset($1::jsonb) AS w(run_id text, attempt integer, decision_id uuid, waiting_for text, tenant text, labels jsonb,
                                        sensitive boolean, gpus integer, nodes integer, needs jsonb, checked_sha text, decided_at timestamptz)
WHERE NOT EXISTS (SELECT 1 FROM decision_keys d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id;

-- name: waiting_on_release
-- Runs still waiting that a release may concern: for quota headroom of tenant $1 (or, with $2,
-- of the sensitive pool), or on one of policies $3 (a run refused by a quota and a budget waits
-- for quota headroom and needs the budget too, and may be waiting on the budget alone by now).
SELECT w.* FROM waiting_runs w
WHERE ((w.waiting_for = 'quota' AND (w.tenant = $1 OR ($2 AND w.sensitive))) OR w.policy_ids && $3::text[])
  AND NOT EXISTS (SELECT 1 FROM decision_keys d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
ORDER BY w.run_id;

-- name: waiting_unchecked
-- Runs still waiting not yet judged under bundle $1 (a limit may have risen), $2 at a time,
-- claimed so that one reconciler judges each.
SELECT w.* FROM waiting_runs w
WHERE w.checked_sha IS DISTINCT FROM $1
  AND NOT EXISTS (SELECT 1 FROM decision_keys d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
ORDER BY w.run_id LIMIT $2 FOR UPDATE OF w SKIP LOCKED;

-- name: mark_waiting_checked
UPDATE waiting_runs SET checked_sha = $2 WHERE decision_id = ANY($1::uuid[]);

-- name: insert_headroom_notices
-- The notices of one cause ($2) for decisions $1; returns those not sent before.
INSERT INTO headroom_notices (decision_id, cause) SELECT d, $2 FROM unnest($1::uuid[]) AS d
ON CONFLICT DO NOTHING RETURNING decision_id;

-- name: forget_ended_waiting
-- Runs the platform reported ended ($1): they wait for nothing any more.
WITH gone AS (DELETE FROM waiting_runs WHERE run_id = ANY($1::text[]) RETURNING decision_id)
DELETE FROM headroom_notices n USING gone WHERE n.decision_id = gone.decision_id;

-- name: forget_stale_waiting
-- Runs refused before $1: their platform gave up on them; they get no more HEADROOM.
WITH gone AS (DELETE FROM waiting_runs WHERE decided_at < $1 RETURNING decision_id)
DELETE FROM headroom_notices n USING gone WHERE n.decision_id = gone.decision_id;

-- name: prune_admitted_objects
-- One pass of the retention of admitted_objects: the next $4 objects admitted before $1, after
-- ($2, $3) in admission order (admitted_at, uid; NULLs: from the first), are looked at, and those
-- whose run ended before $1 are deleted; returns how many were looked at and deleted, and the
-- last looked at (where the next pass goes on). A run ended when its settlement, last written
-- before $1, is of its latest admission, holds nothing any more (final: actuals replaced its
-- reservation; or released: given back unused) and is not running (a run started late after
-- its release runs on). A run with no settlement (never settled, denied, an unknown run id) or
-- admitted again after the admission settled has no end yet: its objects stay, however old.
WITH looked AS (
    -- Whether the run ended is read per object (a subquery of the target list, run for the rows
    -- the LIMIT keeps), by the keys of run_settlements and decision_keys: never a scan of either.
    SELECT o.uid, o.admitted_at, EXISTS (
        SELECT 1 FROM run_settlements s
        WHERE s.run_id = o.run_id AND (s.final OR s.released) AND s.phase <> 'running' AND s.settled_at < $1
          AND s.decision_id = (SELECT k.decision_id FROM decision_keys k WHERE k.run_id = o.run_id AND k.outcome = 'ALLOW' ORDER BY k.attempt DESC LIMIT 1)
    ) AS ended
    FROM admitted_objects o
    WHERE o.admitted_at < $1 AND (o.admitted_at, o.uid) > (COALESCE($2::timestamptz, '-infinity'), COALESCE($3::text, ''))
    ORDER BY o.admitted_at, o.uid LIMIT $4
), gone AS (
    -- By their keys (a join could hash the whole table).
    DELETE FROM admitted_objects WHERE uid = ANY (ARRAY(SELECT l.uid FROM looked l WHERE l.ended)) RETURNING uid
)
SELECT (SELECT count(*) FROM looked) AS looked, (SELECT count(*) FROM gone) AS pruned,
       (SELECT l.admitted_at FROM looked l ORDER BY l.admitted_at DESC, l.uid DESC LIMIT 1) AS last_at,
       (SELECT l.uid FROM looked l ORDER BY l.admitted_at DESC, l.uid DESC LIMIT 1) AS last_uid;
