-- Named queries of the shared ledger, loaded by budgetgate.ledger.queries: those of the ledger itself
-- and every query more than one package asks for. A package's own queries are in its queries.sql
-- (services/<service>/queries.sql, libs/budgetgate/<package>/queries.sql). One block per query.

-- name: lock_every_shard_shared
-- lock_ledger_shared of every shard of a ledger of $1, in shard order: an escrow reclaim, which
-- shrinks leases on other roots' shards in the transaction that grows its own.
SELECT count(pg_advisory_xact_lock_shared(7301, s)) FROM generate_series(0, $1::integer - 1) AS s;

-- name: lock_shards_shared
-- lock_ledger_shared of each shard of $1, in its order (the caller sorts it): a run's settlement on a ledger of several
-- shards, on its tenant's shard and the pools' (its pool token).
SELECT count(pg_advisory_xact_lock_shared(7301, s)) FROM unnest($1::integer[]) AS s;

-- name: lock_ledger_shared
-- Every transaction that changes a shard's ($1) reservations takes this; the shard's rebuild takes
-- it exclusively, so a rebuild never misses a reservation made in Redis but not yet committed here.
SELECT pg_advisory_xact_lock_shared(7301, $1::integer);

-- name: let_go_of_session_locks
-- The session-level advisory locks of a ledger_session (the ledger lock, the runs' locks), let go
-- once its write committed or it failed.
SELECT pg_advisory_unlock_all();

-- name: lock_ledger_exclusive
-- A shard's ($1) rebuild and drift repair: no change to its reservations in between (0044).
SELECT pg_advisory_xact_lock(7301, $1::integer);

-- name: lock_ledger_everywhere
-- Every shard's ledger lock, exclusively, in shard order: a change of what every decision reads
-- (a tenant override, a budget grant) waits for the batches in flight and holds back the next,
-- whatever the shards. All 64 a ledger may have: no setting to read, and a rare change.
SELECT count(pg_advisory_xact_lock(7301, s)) FROM generate_series(0, 63) AS s;

-- name: elect_rebuilder
-- One process rebuilds a lost Redis ledger at a time; the others wait for it rather than queue
-- for the ledger lock. Tried without waiting; held until the transaction ends (or its session
-- does: a rebuilder that dies gives it up with its connection).
SELECT pg_try_advisory_xact_lock(7303, $1::integer);

-- name: lock_run
-- Serialises every decision about one run id, across processes.
SELECT pg_advisory_xact_lock(7302, hashtext($1));

-- name: latest_decision
SELECT decision_id, run_id, attempt, outcome, response, decided_at, namespace, labels
FROM decisions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1;

-- name: committed_shard_seq
-- The highest ledger sequence Postgres committed of one shard ($1 of $2, budgetgate.core.shards),
-- by a decision or another tightening write.
SELECT budgetgate_committed_ledger_seq($1::integer, $2::integer);

-- name: record_ledger_mark
-- A write other than a decision that tightened Redis's ledger, by the sequence number Redis gave
-- it; no row back when the number is recorded already (Redis handed it out twice).
INSERT INTO ledger_marks (ledger_seq) VALUES ($1) ON CONFLICT (ledger_seq) DO NOTHING RETURNING 1;

-- name: insert_outbox
INSERT INTO outbox (topic, key, payload, headers) VALUES ($1, $2, $3, $4);

-- name: ledger_figures
-- Postgres's truth for ledger keys: consumed, and reserved as the sum of held reservations; an
-- escrow lease's size (migration 0041), NULL for any other key.
SELECT e.ledger_key, e.limit_amount, e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved,
       (SELECT l.size FROM escrow_leases l WHERE l.lease_key = e.ledger_key) AS size
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- name: escrow_sizes
-- The size of every escrow lease (migration 0041), for a rebuild of Redis.
SELECT lease_key, size FROM escrow_leases;

-- name: all_ledger_figures
SELECT e.ledger_key, e.limit_amount, e.consumed,
       COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
GROUP BY e.ledger_key;

-- name: ledger_figures_page
-- The drift check's pages: ledger keys after $1, $2 at a time, with Postgres's figures.
SELECT e.ledger_key, e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key > $1 ORDER BY e.ledger_key LIMIT $2;

-- name: ledger_figures_of
SELECT e.ledger_key, e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- name: held_of_runs
SELECT run_id, ledger_key, amount FROM reservations WHERE state = 'held' AND run_id = ANY($1::text[]);

-- name: held_runs_page
-- Runs holding reservations, after $1, $2 at a time, each with one of its ledger keys (every key
-- of a run is on its tenant's shard: the drift check of a shard looks only at its own runs).
SELECT run_id, min(ledger_key) AS ledger_key FROM reservations WHERE state = 'held' AND run_id > $1 GROUP BY run_id ORDER BY run_id LIMIT $2;

-- name: held_reservations
SELECT run_id, decision_id, ledger_key, amount, created_at FROM reservations WHERE state = 'held';

-- name: outlook_holds
-- The reservations held on ledger keys $1, for when room appears (core/eligibility.py), summed
-- per instant that matters: an unstarted run's start deadline (the reconciler's once it has
-- settled the run, else admission + $2 seconds; rounded up to the second), by which it gives its
-- reservation back, and a started run's expected end (to the hour: rolling windows age by hour).
WITH held AS (
    SELECT r.ledger_key, r.amount,
           (s.phase IS NOT NULL AND s.phase NOT IN ('admitted', 'evicted')) AS started,
           COALESCE(s.review_at, r.created_at + make_interval(secs => $2::float8)) AS deadline,
           r.expected_end
    FROM reservations r LEFT JOIN run_settlements s ON s.run_id = r.run_id
    WHERE r.ledger_key = ANY($1::text[]) AND r.state = 'held' AND r.amount > 0
)
SELECT ledger_key, started,
       CASE WHEN started THEN date_trunc('hour', expected_end)
            ELSE date_trunc('second', deadline) + CASE WHEN deadline > date_trunc('second', deadline) THEN interval '1 second' ELSE interval '0' END
       END AS at,
       SUM(amount)::bigint AS amount
FROM held GROUP BY 1, 2, 3;

-- name: outlook_buckets
-- What rolling-window keys $1 have consumed per hour bucket that has not aged out yet.
SELECT c.ledger_key, c.bucket, SUM(c.amount)::bigint AS amount
FROM run_charges c LEFT JOIN rolling_ages a ON a.ledger_key = c.ledger_key
WHERE c.ledger_key = ANY($1::text[]) AND c.bucket >= COALESCE(a.aged_through, '-infinity'::timestamptz)
GROUP BY c.ledger_key, c.bucket;

-- name: active_bundle
SELECT b.git_sha, b.documents, a.seq FROM policy_activations a JOIN policy_bundles b USING (git_sha)
ORDER BY a.seq DESC LIMIT 1;

-- name: run_has_decision
SELECT EXISTS (SELECT 1 FROM decision_keys WHERE run_id = $1);

-- name: held_concurrency
SELECT run_id, decision_id, tenant, gpus, nodes, sensitive FROM run_holds WHERE state = 'held';

-- name: held_pool_allocations
SELECT namespace, token, levels, project, sub_namespace, run_id, lease_expires_at FROM pool_allocations
WHERE state = 'held' AND lease_expires_at > $1;

-- name: end_run_holds
-- A run's concurrency holds and pool tokens given back: one row, with `ended` when holds were
-- ended now (not when they were given back before), the tenant and sensitive pool they counted
-- against, and the tokens released now with their levels (a ledger of several shards gives them
-- back in Redis on the pools' shard, apart from the run's holds).
WITH tokens AS (
    UPDATE pool_allocations SET state = 'released', released_at = now() WHERE run_id = $1 AND state = 'held'
    RETURNING token, levels
), holds AS (
    UPDATE run_holds SET state = 'released', ended_at = now() WHERE run_id = $1 AND state = 'held' RETURNING tenant, sensitive
)
SELECT h.sensitive IS NOT NULL AS ended, h.tenant, coalesce(h.sensitive, false) AS sensitive,
       coalesce((SELECT jsonb_agg(jsonb_build_array(t.token, t.levels)) FROM tokens t), '[]') AS tokens
FROM (SELECT 1) AS one LEFT JOIN (SELECT * FROM holds LIMIT 1) AS h ON true;

-- name: reopen_run_holds
-- A run released at its start deadline is running after all: its concurrency holds of decision
-- $2 count again. Returns what they count (none when they are held already, or were never this
-- decision's).
UPDATE run_holds SET state = 'held', ended_at = NULL WHERE run_id = $1 AND decision_id = $2 AND state = 'released'
RETURNING tenant, gpus, nodes, sensitive;

-- name: decision_inputs
-- A run's latest decision with what it was decided on (explain), and its evaluations' amounts
-- in the ledger's units (policy id -> outcome, limit, projected, remaining, admitted, deficit).
SELECT d.decision_id, d.run_id, d.attempt, d.policy_bundle_sha, d.override_revision, d.request, d.response, d.decided_at, d.readings,
       (SELECT jsonb_object_agg(e.policy_id, jsonb_build_array(e.outcome, e.limit_amount, e.projected, e.remaining, e.admitted, e.deficit))
        FROM decision_evaluations e WHERE e.decision_id = d.decision_id AND e.decided_at = d.decided_at) AS amounts
FROM decisions d WHERE d.run_id = $1 ORDER BY d.attempt DESC LIMIT 1;

-- name: log_admin_action
INSERT INTO admin_log (actor, action, subject, details) VALUES ($1, $2, $3, $4::jsonb);

-- name: renew_run_token
-- Run $1 showed at $2 that it is alive: its token (run:<run id>), held with a lease that has not
-- run out at $3, is renewed to $2 + its lease length, as its holder's renewal would renew it
-- (upsert_pool_allocation): the length it was granted with (lease_seconds), else, for a token
-- granted before that was kept (migration 0024), the default of its pool in the bundle that
-- admitted it ($4: pool namespace -> seconds). Never shortened; to the millisecond, as Redis
-- keeps it. Returns the token's levels, its new lease expiry and the one it replaces; no row
-- when nothing was renewed. The row lock re-checks a token released meanwhile.
WITH held AS (
    SELECT a.namespace, a.token, a.lease_expires_at AS before,
           date_trunc('milliseconds', $2::timestamptz + make_interval(secs => COALESCE(a.lease_seconds, ($4::jsonb ->> a.namespace)::integer))) AS expires
    FROM pool_allocations a
    WHERE a.run_id = $1 AND a.token = 'run:' || $1 AND a.state = 'held' AND a.lease_expires_at > $3
    FOR UPDATE
)
UPDATE pool_allocations a SET lease_expires_at = h.expires
FROM held h WHERE a.namespace = h.namespace AND a.token = h.token AND h.expires > h.before
RETURNING a.namespace, a.token, a.levels, h.expires, h.before;

-- name: restore_run_token_lease
-- Takes back renew_run_token for a token Redis no longer held (its lease ran out there first).
UPDATE pool_allocations SET lease_expires_at = $3 WHERE namespace = $1 AND token = $2;

-- tenant overrides (budgetgate/policies/override_store.py) ---------------------------------------------

-- name: override_revision
-- Overrides and grants share one revision sequence (migration 0031): the highest of either.
SELECT GREATEST(COALESCE((SELECT max(revision) FROM tenant_overrides), 0),
                COALESCE((SELECT max(revision) FROM budget_grants), 0))::bigint;

-- name: waiting_decision
-- A decision as a waiting run needs it: who it was for, what it asked, and its evaluations as
-- [policy id, unit, enforcement, outcome, projected] (core/waiting.py budget_needs).
SELECT d.decision_id, d.run_id, d.attempt, d.outcome, d.reason, d.labels, d.decided_at, d.response ->> 'tenant' AS tenant,
       COALESCE(d.gpus, (d.request -> 'resources' ->> 'gpus')::integer) AS gpus,
       COALESCE(d.nodes, (d.request -> 'resources' ->> 'nodes')::integer, 1) AS nodes,
       COALESCE((SELECT jsonb_agg(jsonb_build_array(e.policy_id, e.unit, e.enforcement, e.outcome, e.projected) ORDER BY e.policy_id)
                 FROM decision_evaluations e WHERE e.decision_id = d.decision_id AND e.decided_at = d.decided_at), '[]'::jsonb) AS evaluations
FROM decisions d WHERE d.decision_id = $1;

-- name: held_by_tenants
-- What each of tenants $1 holds now (Postgres's truth of the quota counters).
SELECT tenant, COALESCE(SUM(gpus), 0)::bigint AS gpus, COALESCE(SUM(nodes), 0)::bigint AS nodes, count(*)::bigint AS allocations
FROM run_holds WHERE state = 'held' AND tenant = ANY($1::text[]) GROUP BY tenant;

-- name: held_sensitive
SELECT COALESCE(SUM(gpus), 0)::bigint AS gpus, COALESCE(SUM(nodes), 0)::bigint AS nodes, count(*)::bigint AS allocations
FROM run_holds WHERE state = 'held' AND sensitive;


-- monthly partitions and archives (budgetgate/ledger/partitions.py, budgetgate/ledger/archive.py) -------------

-- name: ledger_partitions
-- The partitions of the tables $1 with their bounds (NULL for the default partition) and
-- estimated rows, by table and month.
SELECT p.relname AS parent, c.relname AS name, bounds.range_start, bounds.range_end, c.reltuples::bigint AS estimate
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent
CROSS JOIN LATERAL (
    SELECT m[1]::timestamptz AS range_start, m[2]::timestamptz AS range_end
    FROM (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m) AS x
) AS bounds
WHERE p.relname = ANY($1::text[]) AND p.relnamespace = current_schema()::regnamespace
ORDER BY p.relname, bounds.range_start NULLS LAST;

-- name: ledger_detached
-- Tables named as months of the tables $1 that are no partition of theirs (a detach finished and
-- the archive that made it stopped before it dropped them).
SELECT m[1] AS parent, c.relname AS name, make_timestamptz(m[2]::integer, m[3]::integer, 1, 0, 0, 0, 'UTC') AS month
FROM pg_class c CROSS JOIN LATERAL regexp_match(c.relname, '^(.+)_p(\d{4})(\d{2})$') AS m
WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace AND m[1] = ANY($1::text[])
  AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
ORDER BY 3, 1;

-- name: ensure_partitions
-- The partitions of table $1 for this month and the $2 after it (and for months the default
-- partition holds rows of); returns those created.
SELECT budgetgate_ensure_partitions($1, $2);

-- name: archive_needs_decisions
-- Why the decisions of [$1, $2) are still needed: their runs are open (ledger_open_runs); per
-- reason, how many runs and the first few.
SELECT o.reason, count(DISTINCT o.run_id) AS runs, (array_agg(DISTINCT o.run_id ORDER BY o.run_id))[1:5] AS examples
FROM (SELECT DISTINCT d.run_id FROM decisions d WHERE d.decided_at >= $1 AND d.decided_at < $2) AS m
JOIN ledger_open_runs o USING (run_id)
GROUP BY o.reason ORDER BY o.reason;

-- name: archive_needs_usage
-- Why the usage records of [$1, $2) are still needed: their runs are open (metering judges a
-- late sample against the records around it).
SELECT o.reason, count(DISTINCT o.run_id) AS runs, (array_agg(DISTINCT o.run_id ORDER BY o.run_id))[1:5] AS examples
FROM (SELECT DISTINCT u.run_id FROM usage_records u WHERE u.observed_at >= $1 AND u.observed_at < $2) AS m
JOIN ledger_open_runs o USING (run_id)
GROUP BY o.reason ORDER BY o.reason;

-- name: archive_needs_outbox
-- The outbox rows of [$1, $2) not published yet: their month stays until the relay sends them.
SELECT 'it is not published yet' AS reason, count(*) AS runs, (array_agg(o.id::text ORDER BY o.id))[1:5] AS examples
FROM outbox o WHERE o.created_at >= $1 AND o.created_at < $2 AND o.published_at IS NULL
HAVING count(*) > 0;

-- name: archive_waits_decisions
-- The runs decided in [$1, $2) with usage observed at or after $3 (in a month kept): chargeback
-- reports of that month read their decisions, which wait until that usage is archived too.
SELECT 'its run has usage in a month kept (chargeback reads the decision)' AS reason, count(*) AS runs,
       (array_agg(m.run_id ORDER BY m.run_id))[1:5] AS examples
FROM (SELECT DISTINCT d.run_id FROM decisions d WHERE d.decided_at >= $1 AND d.decided_at < $2) AS m
WHERE EXISTS (SELECT 1 FROM usage_records u WHERE u.run_id = m.run_id AND u.observed_at >= $3)
HAVING count(*) > 0;

-- name: record_archive
INSERT INTO ledger_archives (partition, parent, range_start, range_end, row_count, sha256, location) VALUES ($1, $2, $3, $4, $5, $6, $7);

-- name: ledger_archives
-- The months archived of tables $1 (NULL: every table), by table and month.
SELECT partition, parent, range_start, range_end, row_count, sha256, location, archived_at FROM ledger_archives
WHERE $1::text[] IS NULL OR parent = ANY($1::text[]) ORDER BY parent, range_start;

-- name: archives_within
-- The months archived of table $1 that overlap [$2, $3): what a reading of that period cannot see.
SELECT partition, range_start, range_end, row_count, location FROM ledger_archives
WHERE parent = $1 AND range_end > $2 AND range_start < $3 ORDER BY range_start;

-- name: unarchive
DELETE FROM ledger_archives WHERE partition = $1;

-- name: archived_decision
-- A run whose latest decision is archived: its keys and the archive holding it (no row when the
-- run has no decision, or its latest is not archived).
SELECT k.run_id, k.decision_id, k.attempt, k.decided_at, a.partition, a.location
FROM (SELECT * FROM decision_keys WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1) AS k
JOIN ledger_archives a ON a.parent = 'decisions' AND k.decided_at >= a.range_start AND k.decided_at < a.range_end;

-- name: escrow_open
-- The lease of root $2 on the budget filed under $1, as ledger key $3 with scope id $4: its own
-- ledger entry (the budget's window, unit, policy and limit, for reference: its limit in Redis is
-- its size) and its escrow_leases row, of size 0, unless they exist. No row back when the budget
-- has no ledger entry. Migration 0041. The row's two unique keys (budget and root, the lease key)
-- name one lease: a conflict on either is the lease opened already, by a batch at the same moment
-- too (ON CONFLICT with no target; naming the first alone, an insert racing another's met it on
-- the second's index and failed with a unique violation).
WITH budget AS (
    SELECT * FROM ledger_entries WHERE ledger_key = $1
), entry AS (
    INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount)
    SELECT $3, $4, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount FROM budget
    ON CONFLICT (ledger_key) DO NOTHING
), lease AS (
    INSERT INTO escrow_leases (ledger_key, root, lease_key, size)
    SELECT $1, $2, $3, 0 FROM budget
    ON CONFLICT DO NOTHING
)
SELECT 1 FROM budget;

-- name: escrow_lock_budget
-- The budget's limit, its entry locked: every move of its leases takes this lock first, then
-- reads its leases (escrow_leases_read), so moves of one budget are made one at a time.
SELECT limit_amount FROM ledger_entries WHERE ledger_key = $1 FOR UPDATE;

-- name: escrow_leases_read
-- Every lease of the budget $1 and its limit, with what Postgres knows each holds (consumed, and
-- the held reservations committed). A move reads them under the budget entry's lock, which every
-- move takes first (escrow_lock_budget), so the leases' rows take no lock of their own: locking
-- each wrote every row of the budget's leases at every grant. A quote reads them unlocked.
SELECT l.root, l.size, e.consumed, b.limit_amount,
       COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = l.lease_key AND r.state = 'held'), 0)::bigint AS reserved
FROM escrow_leases l JOIN ledger_entries e ON e.ledger_key = l.lease_key JOIN ledger_entries b ON b.ledger_key = l.ledger_key
WHERE l.ledger_key = $1;

-- name: escrow_budgets
-- Every budget carved into leases, with its limit.
SELECT e.ledger_key, e.limit_amount FROM ledger_entries e
WHERE EXISTS (SELECT 1 FROM escrow_leases l WHERE l.ledger_key = e.ledger_key)
ORDER BY e.ledger_key;

-- name: escrow_idle_leases
-- The roots whose lease of the budget $1 has not moved since $2 (their figures are read with
-- every lease's: escrow_leases_read).
SELECT l.root FROM escrow_leases l
WHERE l.ledger_key = $1
  AND NOT EXISTS (SELECT 1 FROM escrow_moves m WHERE m.ledger_key = l.ledger_key AND m.root = l.root AND m.moved_at > $2)
ORDER BY l.root;

-- name: escrow_move
-- A lease's new size $4 after a move ($3: grant or return) of $5, recorded with its ledger
-- sequence $6 (a return's) and reason $7.
WITH moved AS (
    UPDATE escrow_leases SET size = $4 WHERE ledger_key = $1 AND root = $2 RETURNING size
)
INSERT INTO escrow_moves (ledger_key, root, kind, amount, size_after, ledger_seq, reason)
SELECT $1, $2, $3, $5, size, $6, $7 FROM moved;

-- name: counter_escrow_open
-- The lease of tenant $2 of counter $1 (the sensitive pool), size 0, unless it exists; the
-- counter's row too (migration 0045).
WITH pool AS (
    INSERT INTO counter_pools (counter) VALUES ($1) ON CONFLICT (counter) DO NOTHING
)
INSERT INTO counter_leases (counter, root, size) VALUES ($1, $2, 0) ON CONFLICT (counter, root) DO NOTHING;

-- name: counter_escrow_lock
-- The counter's row, locked: every move of its leases takes this lock first, so they are made
-- one at a time (the counter's escrow_lock_budget).
SELECT counter FROM counter_pools WHERE counter = $1 FOR UPDATE;

-- name: counter_leases_figures
-- Every lease of counter $1 with what its tenant's sensitive runs hold in unit $2 (gpus or
-- nodes), and what tenants without a lease hold (a run held before the ledger was sharded, or
-- of no tenant: root ''), so what is free leaves it out too. Read under counter_escrow_lock.
WITH held AS (
    SELECT COALESCE(tenant, '') AS root, SUM(CASE WHEN $2 = 'gpus' THEN gpus ELSE nodes END)::bigint AS used
    FROM run_holds WHERE state = 'held' AND sensitive GROUP BY 1
)
SELECT COALESCE(l.root, h.root) AS root, COALESCE(l.size, 0)::bigint AS size, COALESCE(h.used, 0)::bigint AS reserved, 0::bigint AS consumed
FROM (SELECT root, CASE WHEN unit = $2 THEN size ELSE 0 END AS size FROM counter_leases WHERE counter = $1) l FULL JOIN held h ON h.root = l.root
ORDER BY 1;

-- name: counter_leases_otherwise
-- The leases of counter $1 sized in another unit than $2 (or in none recorded, migration 0047),
-- and not empty: a size in another unit holds nothing of this one (escrow_leases.void_other_units).
SELECT root, size FROM counter_leases WHERE counter = $1 AND unit IS DISTINCT FROM $2 AND size > 0 ORDER BY root;

-- name: counter_escrow_move
-- A lease's new size $4 in unit $8 after a move ($3: grant or return) of $5, recorded with its
-- ledger sequence $6 (a return's) and reason $7, in escrow_moves under 'counter:' || $1.
WITH moved AS (
    UPDATE counter_leases SET size = $4, unit = $8 WHERE counter = $1 AND root = $2 RETURNING size
)
INSERT INTO escrow_moves (ledger_key, root, kind, amount, size_after, ledger_seq, reason)
SELECT 'counter:' || $1, $2, $3, $5, size, $6, $7 FROM moved;

-- name: counter_lease_sizes
-- The size of every lease of a counter and its unit, for a rebuild of Redis and the drift check.
SELECT counter, root, size, unit FROM counter_leases;

-- name: counter_idle_roots
-- The tenants whose lease of counter $1 has not moved since $2.
SELECT l.root FROM counter_leases l
WHERE l.counter = $1
  AND NOT EXISTS (SELECT 1 FROM escrow_moves m WHERE m.ledger_key = 'counter:' || l.counter AND m.root = l.root AND m.moved_at > $2)
ORDER BY l.root;

-- name: escrow_moves_since
-- The escrow moves made after $1, counted by what was moved (a budget's ledger key, or
-- 'counter:<name>'), their kind and the first word of their reason (a reclaim's names the tenant).
SELECT ledger_key, kind, split_part(reason, ':', 1) AS reason, count(*)::bigint AS moves, SUM(amount)::bigint AS amount
FROM escrow_moves WHERE moved_at > $1
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

-- name: pinned_roots
-- The roots pinned for the Redis ledger's shards (0049): tenant -> organisation.
SELECT tenant, root FROM ledger_roots ORDER BY tenant;

-- name: pin_roots
-- Replace the pinned roots with $1 (tenants) -> $2 (organisations), from the bundle $3.
WITH gone AS (DELETE FROM ledger_roots WHERE tenant <> ALL($1::text[]))
INSERT INTO ledger_roots (tenant, root, bundle_sha)
SELECT * FROM unnest($1::text[], $2::text[]), (VALUES ($3::text)) AS b(sha)
ON CONFLICT (tenant) DO UPDATE SET root = EXCLUDED.root, bundle_sha = EXCLUDED.bundle_sha, pinned_at = now();

-- name: other_sessions
-- The other client sessions on this database (a change of the pinned roots wants every
-- budgetgate process stopped).
SELECT pid, application_name, client_addr::text AS client, backend_start
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
ORDER BY pid;
