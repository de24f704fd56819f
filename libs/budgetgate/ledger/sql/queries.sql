-- Named queries of the ledger, loaded by budgetgate.ledger.queries. One block per query.

-- name: lock_ledger_shared
-- Every transaction that changes reservations takes this; a Redis rebuild takes it exclusively,
-- so a rebuild never misses a reservation made in Redis but not yet committed here.
SELECT pg_advisory_xact_lock_shared(7301, 0);

-- name: lock_ledger_exclusive
SELECT pg_advisory_xact_lock(7301, 0);

-- name: elect_rebuilder
-- One process rebuilds a lost Redis ledger at a time; the others wait for it rather than queue
-- for the ledger lock. Tried without waiting; held until the transaction ends (or its session
-- does: a rebuilder that dies gives it up with its connection).
SELECT pg_try_advisory_xact_lock(7303, 0);

-- name: lock_run
-- Serialises every decision about one run id, across processes.
SELECT pg_advisory_xact_lock(7302, hashtext($1));

-- name: latest_decision
SELECT decision_id, run_id, attempt, outcome, response, decided_at, namespace, labels
FROM decisions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1;

-- name: begin_batch
-- Ledger lock (shared) + the lock of every run of a batch; then a row with only the highest
-- ledger sequence Postgres committed and the highest tenant override revision, then each run's
-- latest decision: one round trip.
SELECT run_id, decision_id, attempt, outcome, request, response, committed_seq, override_revision FROM budgetgate_begin_batch($1::text[]);

-- name: committed_ledger_seq
-- The highest ledger sequence Postgres committed, by a decision or another tightening write.
SELECT budgetgate_committed_ledger_seq();

-- name: record_ledger_mark
-- A write other than a decision that tightened Redis's ledger, by the sequence number Redis gave
-- it; no row back when the number is recorded already (Redis handed it out twice).
INSERT INTO ledger_marks (ledger_seq) VALUES ($1) ON CONFLICT (ledger_seq) DO NOTHING RETURNING 1;

-- name: prune_ledger_marks
-- Only the highest mark counts (budgetgate_committed_ledger_seq); the others go.
DELETE FROM ledger_marks WHERE ledger_seq < (SELECT max(ledger_seq) FROM ledger_marks);

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
        entries jsonb, reservations jsonb, holds jsonb, token jsonb)
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
                                      admitted, deficit, next_eligible_time)
    SELECT b.decision_id, e.*
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
)
INSERT INTO outbox (topic, headers, records, keys, payloads, event_ids)
VALUES ($2, $6::jsonb, cardinality($4::bytea[]), $3::text[], $4::bytea[], $5::text[]);

-- name: insert_outbox
INSERT INTO outbox (topic, key, payload, headers) VALUES ($1, $2, $3, $4);

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

-- name: ledger_figures
-- Postgres's truth for ledger keys: consumed, and reserved as the sum of held reservations.
SELECT e.ledger_key, e.limit_amount, e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

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
-- Runs holding reservations, after $1, $2 at a time.
SELECT DISTINCT run_id FROM reservations WHERE state = 'held' AND run_id > $1 ORDER BY run_id LIMIT $2;

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

-- name: claim_outbox
-- Pending rows in id order, locked, as long as they carry at most $1 records in all (the first
-- row whatever it carries). `o.published_at IS NULL` again outside `pending`: a row another
-- relay published and committed after this statement's snapshot is locked all the same, and
-- only the conditions on `o` are checked again on the row as it is then. `more`: pending rows
-- were left for the next claim because of the limit.
WITH pending AS (
    SELECT p.id, sum(p.records) OVER (ORDER BY p.id) AS upto
    FROM (SELECT id, records FROM outbox WHERE published_at IS NULL ORDER BY id LIMIT $1) AS p
)
SELECT o.id, o.topic, o.key, o.payload, o.headers, o.keys, o.payloads, o.event_ids,
       (SELECT max(upto) FROM pending) > $1 AS more
FROM outbox o JOIN pending p ON p.id = o.id
WHERE o.published_at IS NULL AND (p.upto <= $1 OR p.id = (SELECT min(id) FROM pending))
ORDER BY o.id FOR UPDATE OF o SKIP LOCKED;

-- name: insert_outbox_bundle
-- A bundle of records of one topic ($1): their keys, payloads and event ids, and the headers
-- they share (jsonb text).
INSERT INTO outbox (topic, headers, records, keys, payloads, event_ids)
VALUES ($1, $5::jsonb, cardinality($3::bytea[]), $2::text[], $3::bytea[], $4::text[]);

-- name: mark_published
-- Rows the broker acknowledged every record of: ($1 row id, $2 partition) pairs, one for each
-- partition a row's records went to; and the lowest offset each partition acknowledged in the
-- batch ($3 topics, $4 partitions, $5 offsets: one per partition).
WITH acked AS (
    SELECT a.id, array_agg(DISTINCT a.kafka_partition ORDER BY a.kafka_partition) AS partitions
    FROM unnest($1::bigint[], $2::integer[]) AS a(id, kafka_partition) GROUP BY a.id
), marked AS (
    UPDATE outbox o SET published_at = now(), kafka_partitions = a.partitions
    FROM acked a WHERE o.id = a.id
)
INSERT INTO outbox_watermarks AS w (topic, kafka_partition, acked_offset)
SELECT * FROM unnest($3::text[], $4::integer[], $5::bigint[])
ON CONFLICT (topic, kafka_partition)
DO UPDATE SET acked_offset = GREATEST(w.acked_offset, EXCLUDED.acked_offset), updated_at = now();

-- name: outbox_watermarks
-- What the broker acknowledged, per partition of the topics under prefix $1.
SELECT topic, kafka_partition, acked_offset FROM outbox_watermarks WHERE starts_with(topic, $1);

-- name: replay_partition
-- A partition ($1 topic in Kafka, $2 partition) now shows offset $3 (its end, or the lowest of a
-- new acknowledgement): at or below the watermark any relay stored for it, it lost what it had
-- acknowledged, and its rows published within the window ($4 topic in the outbox, $5 window) are
-- pending again. Compared with the stored watermark, not with what the caller remembers (another
-- relay may have moved it since). Nothing happens when another relay replayed it already (the
-- watermark is gone, or is one the partition has passed since).
WITH forgotten AS (
    DELETE FROM outbox_watermarks WHERE topic = $1 AND kafka_partition = $2 AND acked_offset >= $3
    RETURNING 1
)
UPDATE outbox SET published_at = NULL, kafka_partitions = NULL
WHERE topic = $4 AND $2 = ANY(kafka_partitions) AND published_at >= now() - $5::interval
  AND EXISTS (SELECT FROM forgotten);

-- name: prune_outbox
-- Published rows older than the replay window ($1), at most $2 at a time.
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE published_at < now() - $1::interval ORDER BY published_at LIMIT $2
);

-- name: insert_bundle
INSERT INTO policy_bundles (git_sha, documents, source, applied_by) VALUES ($1, $2, $3, $4)
ON CONFLICT (git_sha) DO NOTHING;

-- name: activate_bundle
INSERT INTO policy_activations (git_sha) VALUES ($1) RETURNING seq;

-- name: active_bundle
SELECT b.git_sha, b.documents, a.seq FROM policy_activations a JOIN policy_bundles b USING (git_sha)
ORDER BY a.seq DESC LIMIT 1;

-- name: update_policy_limits
-- A new policy revision changes the limit of its current and future windows, never closed ones.
UPDATE ledger_entries SET limit_amount = $2, policy_git_sha = $3, updated_at = now()
WHERE policy_id = $1 AND unit = $4 AND (window_end IS NULL OR window_end > now());

-- name: scope_figures
SELECT e.ledger_key, e.policy_id, e.policy_git_sha, e.unit, e.window_start, e.window_end, e.limit_amount,
       e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
FROM ledger_entries e WHERE e.ledger_key = ANY($1::text[]);

-- inbox (libs/budgetgate/messaging/inbox.py) ---------------------------------------------------------

-- name: inbox_claim
-- The inbox rows of one batch ($2 event ids, distinct and sorted; $3 their topics); returns the
-- ids that were NOT new (in the inbox already): usually none, so a batch of thousands costs no
-- rows back.
WITH claimed AS (
    INSERT INTO inbox (consumer, event_id, topic)
    SELECT $1, e.event_id, e.topic FROM unnest($2::text[], $3::text[]) AS e(event_id, topic)
    ON CONFLICT DO NOTHING
    RETURNING event_id
)
SELECT e.event_id FROM unnest($2::text[]) AS e(event_id)
WHERE e.event_id NOT IN (SELECT c.event_id FROM claimed c);

-- name: inbox_forget
-- Removes the inbox rows of messages a handler refused, so a redelivery finds them poison again.
DELETE FROM inbox WHERE consumer = $1 AND event_id = ANY($2::text[]);

-- metering-ingest ------------------------------------------------------------------------------

-- name: lock_usage_run
-- Serialises everything that changes one run's usage (the Kafka consumer, HTTP ingest, the
-- pending re-check), across processes.
SELECT pg_advisory_xact_lock(7310, hashtext($1));

-- name: usage_run
SELECT gpu_milli_hours_cumulative, node_milli_hours_cumulative, latest_observed_at
FROM usage_runs WHERE run_id = $1;

-- name: run_has_decision
SELECT EXISTS (SELECT 1 FROM decisions WHERE run_id = $1);

-- name: insert_usage_run
INSERT INTO usage_runs (run_id) VALUES ($1) ON CONFLICT (run_id) DO NOTHING;

-- name: usage_neighbours
-- The recorded samples a new one is judged against: the same sample id, the same observed_at,
-- the latest observed before it and the earliest observed after it.
(SELECT 'same_id' AS role, sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND sample_id = $2)
UNION ALL
(SELECT 'same_time', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at = $3)
UNION ALL
(SELECT 'before', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at < $3 ORDER BY observed_at DESC LIMIT 1)
UNION ALL
(SELECT 'after', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at > $3 ORDER BY observed_at LIMIT 1);

-- name: begin_sample
-- The run's lock, its state and the recorded neighbours of a sample (see metering_begin_sample).
SELECT role, sample_id, observed_at, gpu_milli_hours, node_milli_hours FROM metering_begin_sample($1, $2, $3);

-- name: record_usage
-- An accepted sample, its run's new high-water mark and the outbox row of its usage record
-- ($14 topic, $15 key, $16 payload, $17 headers): one statement, one round trip.
WITH recorded AS (
    INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours,
                               gpu_milli_hours_cumulative, node_milli_hours_cumulative, gpu_milli_hours_delta,
                               node_milli_hours_delta, late, exporter, source, event_id)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
), run AS (
    UPDATE usage_runs
    SET gpu_milli_hours_cumulative = $6, node_milli_hours_cumulative = $7, samples = samples + 1,
        latest_observed_at = GREATEST(latest_observed_at, $3), updated_at = now()
    WHERE run_id = $1
)
INSERT INTO outbox (topic, key, payload, headers) VALUES ($14, $15, $16, $17);

-- name: metering_begin_batch
-- The runs' locks, their state and the recorded neighbours of every sample of a batch
-- (see metering_begin_batch).
SELECT idx, role, run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours
FROM metering_begin_batch($1::text[], $2::text[], $3::timestamptz[]);

-- name: metering_place_batch
-- A batch's samples judged and recorded set-based where the core's rules allow it, the others
-- left to the core (see metering_place_batch): one row per sample, by its 1-based idx.
SELECT idx, outcome, of_sample, gpu_cumulative, node_cumulative, gpu_delta, node_delta, late
FROM metering_place_batch($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::bigint[], $6::text[], $7::text[], $8::text[]);

-- name: raise_usage_runs
-- The new high-water marks of the runs a batch recorded samples of: per run its cumulative
-- counters after the batch, how many samples it added and the latest observed_at among them.
UPDATE usage_runs r
SET gpu_milli_hours_cumulative = x.gpu, node_milli_hours_cumulative = x.node, samples = r.samples + x.added,
    latest_observed_at = GREATEST(r.latest_observed_at, x.latest), updated_at = now()
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::integer[], $5::timestamptz[]) AS x(run_id, gpu, node, added, latest)
WHERE r.run_id = x.run_id;

-- name: insert_pending
-- Keep a sample until its run is known, with its sender's limits ($11 the sender limited to
-- namespaces $12 and tenants $13; '' and none for a sender not limited). When one of the same id
-- from the same sender is kept already, the new one is not, and the kept one's payload comes
-- back (for the caller to tell a resend from a conflict).
WITH kept AS (
    INSERT INTO metering_pending (run_id, sample_id, observed_at, expires_at, source, topic, kafka_partition,
                                  kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
    ON CONFLICT (run_id, sample_id, sender) DO NOTHING
    RETURNING 1
)
SELECT p.payload, p.headers FROM metering_pending p
WHERE p.run_id = $1 AND p.sample_id = $2 AND p.sender = $11 AND NOT EXISTS (SELECT 1 FROM kept);

-- name: take_pending_of_run
DELETE FROM metering_pending WHERE run_id = $1
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants;

-- name: run_owners
-- The namespace and tenant (the value of label $2) of each run of $1 that has a decision, as its
-- latest decision names them (admission keeps both in every attempt of a run); one index probe a run.
SELECT DISTINCT ON (run_id) run_id, namespace, labels ->> $2 AS tenant
FROM decisions WHERE run_id = ANY($1::text[]) ORDER BY run_id, attempt DESC;

-- name: pending_runs_with_decision
SELECT DISTINCT p.run_id FROM metering_pending p
WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p.run_id) LIMIT $1;

-- name: take_expired_pending
-- Pending samples past their grace period whose run still has no decision, taken to be
-- dead-lettered in the same transaction. SKIP LOCKED: instances side by side share the work.
DELETE FROM metering_pending
WHERE (run_id, sample_id, sender) IN (
    SELECT p.run_id, p.sample_id, p.sender FROM metering_pending p
    WHERE p.expires_at <= $1 AND NOT EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p.run_id)
    ORDER BY p.expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING run_id, sample_id, observed_at, source, topic, kafka_partition, kafka_offset, payload, headers, sender, sender_namespaces, sender_tenants;

-- name: pending_count
SELECT count(*) FROM metering_pending;

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
-- the tenant its concurrency holds were taken for, and whether an earlier attempt was refused.
SELECT d.decision_id, d.decided_at, d.policy_bundle_sha, d.projected_gpu, d.gpus, d.nodes, d.flavor, d.region, d.labels,
       d.job_namespace, d.job_name, (SELECT h.tenant FROM run_holds h WHERE h.run_id = d.run_id) AS tenant,
       EXISTS (SELECT 1 FROM decisions r WHERE r.run_id = d.run_id AND r.attempt < d.attempt AND r.outcome <> 'ALLOW') AS after_refusal
FROM decisions d WHERE d.run_id = $1 AND d.outcome = 'ALLOW' ORDER BY d.attempt DESC LIMIT 1;

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
SELECT e.consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r WHERE r.ledger_key = e.ledger_key AND r.state = 'held'), 0)::bigint AS reserved
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
-- the limit a tenant override sets for the policy, else $9 (the bundle's).
INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id,
                            policy_git_sha, limit_amount)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, COALESCE(
    (SELECT (s.value ->> 'amount')::bigint FROM tenant_overrides_current o, jsonb_each(o.settings) s
     WHERE s.value ->> 'policy_id' = $7 AND s.value ->> 'unit' = $3 LIMIT 1), $9))
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
INSERT INTO budget_alerts (ledger_key, threshold_percent) VALUES ($1, $2)
ON CONFLICT (ledger_key, threshold_percent) DO NOTHING RETURNING true;

-- name: rearm_alerts
-- A rolling window whose usage aged out below a threshold may cross it again.
DELETE FROM budget_alerts WHERE ledger_key = $1 AND threshold_percent::numeric * $3 > $2::numeric * 100;

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

-- name: fair_share_usages
SELECT tenant, decayed_gpu, reckoned_at, half_life_seconds FROM fair_share_usage;

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

-- name: evidence_insert_event
-- One OpenLineage event per consumed message; a redelivered message adds nothing.
INSERT INTO evidence_events (source_event_id, stage, run_id, run_uuid, decision_id, event_type, event_time, payload, state)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (source_event_id) DO NOTHING;

-- name: evidence_waiting_for_run
SELECT seq, payload FROM evidence_events WHERE run_id = $1 AND state = 'waiting' ORDER BY seq FOR UPDATE;

-- name: evidence_settle_waiting
-- A waiting reconciliation event, rebuilt on its decision's facet (and typed again, $3, after its
-- decision's own event), released to the sender.
UPDATE evidence_events SET payload = $2, event_type = $3, state = 'pending', next_attempt_at = now() WHERE seq = $1 AND state = 'waiting';

-- name: evidence_waiting_decided
-- Runs with a reconciliation waiting for a decision that is stored (the two consumed at the same
-- time, each transaction missing the other's row): handlers.release_decided releases them.
SELECT DISTINCT w.run_id FROM evidence_events w
WHERE w.state = 'waiting'
  AND EXISTS (SELECT 1 FROM evidence_events d
              WHERE d.run_id = w.run_id AND d.stage = 'decision' AND (w.decision_id IS NULL OR d.decision_id = w.decision_id))
LIMIT $1;

-- name: evidence_release_stale
-- Reconciliations whose decision never came within $1 seconds go out with the inferred one.
UPDATE evidence_events SET state = 'pending', next_attempt_at = now()
WHERE state = 'waiting' AND created_at < now() - make_interval(secs => $1);

-- name: evidence_decision_event
-- The event of the decision a reconciliation settles: that decision's when named, else the run's latest.
SELECT payload FROM evidence_events
WHERE run_id = $1 AND stage = 'decision' AND ($2::text IS NULL OR decision_id = $2)
ORDER BY seq DESC LIMIT 1;

-- name: evidence_terminal_sent
-- Whether the run's current life has its terminal event already: a COMPLETE, FAIL or ABORT of the
-- decision of its latest START (or of no named decision), or of any decision when it never
-- started. An attempt refused (ABORT) and a later one admitted (START) start the run again in
-- Marquez, and that life's own end must go out as terminal, not as OTHER; counted by decision,
-- not by order of storing, because a reconciliation that waited for its decision is stored first.
-- Events still waiting for their decision do not count: they are typed again when released.
SELECT EXISTS (SELECT 1 FROM evidence_events t
               WHERE t.run_id = $1 AND t.event_type IN ('COMPLETE', 'FAIL', 'ABORT') AND t.state <> 'waiting'
                 AND (t.decision_id IS NULL
                      OR t.decision_id = COALESCE((SELECT s.decision_id FROM evidence_events s
                                                   WHERE s.run_id = $1 AND s.event_type = 'START'
                                                   ORDER BY s.seq DESC LIMIT 1), t.decision_id)));

-- name: evidence_insert_reconciliation
INSERT INTO evidence_reconciliations (event_id, run_id, decision_id, final_state, terminal, provisional,
                                      policy_git_sha, projected_gpu, actual_gpu, reconciled_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (event_id) DO NOTHING;

-- name: evidence_insert_charges
INSERT INTO evidence_reconciliation_charges (event_id, ledger_key, scope_id, window_key, window_start, window_end,
                                             policy_id, unit, amount)
SELECT $1, * FROM unnest($2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::timestamptz[],
                         $7::text[], $8::text[], $9::bigint[])
ON CONFLICT DO NOTHING;

-- name: evidence_next_batch
-- Pending events due now, oldest first, at most one per run: a run's later events (by event
-- time) wait for its earlier ones, so Marquez sees each run's transitions in order.
SELECT e.seq, e.payload, e.attempts FROM evidence_events e
WHERE e.state = 'pending' AND e.next_attempt_at <= now()
  AND NOT EXISTS (SELECT 1 FROM evidence_events b
                  WHERE b.run_uuid = e.run_uuid AND b.state = 'pending'
                    AND (b.event_time, b.seq) < (e.event_time, e.seq))
ORDER BY e.seq LIMIT $1;

-- name: evidence_mark_delivered
UPDATE evidence_events SET state = 'delivered', delivered_at = now(), attempts = attempts + 1, last_error = NULL
WHERE seq = $1;

-- name: evidence_mark_retry
UPDATE evidence_events
SET attempts = attempts + 1, last_error = $2, next_attempt_at = now() + make_interval(secs => $3)
WHERE seq = $1 AND state = 'pending';

-- name: evidence_mark_dead
WITH dead AS (
    UPDATE evidence_events SET state = 'dead', attempts = attempts + 1, last_error = $4
    WHERE seq = $1 RETURNING seq
)
INSERT INTO evidence_dead_letters (seq, status_code, body)
SELECT seq, $2, $3 FROM dead
ON CONFLICT (seq) DO NOTHING;

-- name: evidence_dead_list
-- Dead-lettered evidence events, oldest first: what was refused or kept failing, and why.
SELECT e.seq, e.run_id, e.stage, e.event_type, e.event_time, e.attempts, e.last_error, d.status_code, d.body, d.dead_at
FROM evidence_events e LEFT JOIN evidence_dead_letters d ON d.seq = e.seq
WHERE e.state = 'dead' AND ($1::bigint[] IS NULL OR e.seq = ANY($1::bigint[]))
ORDER BY e.seq LIMIT $2;

-- name: evidence_resend
-- Dead-lettered events ($1 their seqs; NULL: every one) back to pending, due now, with their
-- dead letters removed; returns the seqs. The sender delivers them in their runs' order again.
WITH back AS (
    UPDATE evidence_events SET state = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL
    WHERE state = 'dead' AND ($1::bigint[] IS NULL OR seq = ANY($1::bigint[]))
    RETURNING seq
), forgotten AS (
    DELETE FROM evidence_dead_letters d USING back WHERE d.seq = back.seq
)
SELECT seq FROM back ORDER BY seq;

-- name: evidence_backlog
SELECT count(*) AS pending,
       COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_seconds
FROM evidence_events WHERE state IN ('pending', 'waiting');

-- name: evidence_try_lead
-- One sender at a time (session lock, dropped with its connection), so events go out in order.
SELECT pg_try_advisory_lock(7305, 0);

-- name: evidence_unlead
SELECT pg_advisory_unlock(7305, 0);

-- name: audit_denial_rate_for_scope
-- $2: an instant the window must contain, $3: a window key; both NULL: every window.
SELECT scope_id, window_key, window_start, window_end, runs, allowed, denied, delayed, denial_rate
FROM audit_denial_rate
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start NULLS LAST, window_key NULLS LAST;

-- name: audit_reservation_error_for_scope
SELECT scope_id, window_key, window_start, window_end, policy_git_sha, runs, provisional_runs,
       reserved_gpu, actual_gpu, error_gpu, abs_error_gpu, error_ratio
FROM audit_reservation_error
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start NULLS LAST, window_key, policy_git_sha;

-- name: audit_window_exhaustion_for_scope
SELECT ledger_key, scope_id, policy_id, policy_git_sha, unit, window_key, window_start, window_end,
       limit_amount, used, burn_per_hour, exhausted_at, projected_exhaustion_at
FROM audit_window_exhaustion
WHERE scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (window_start <= $2 AND $2 < window_end) OR window_key = $3)
ORDER BY window_start, policy_id;

-- name: audit_decisions_by_policy_sha_for_scope
-- As audit_decisions_by_policy_sha, for the decisions filed in the windows $2/$3 select (a label
-- violation, decided before any window, counts only when no window is asked for).
SELECT ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement,
       count(*)                                       AS decisions,
       count(*) FILTER (WHERE ev.outcome = 'ALLOW')   AS allowed,
       count(*) FILTER (WHERE ev.outcome = 'DENY')    AS denied,
       count(*) FILTER (WHERE ev.outcome = 'DELAY')   AS delayed,
       min(d.decided_at)                              AS first_decided_at,
       max(d.decided_at)                              AS last_decided_at
FROM decision_evaluations ev JOIN decisions d ON d.decision_id = ev.decision_id
LEFT JOIN ledger_entries le ON le.ledger_key = ev.ledger_key
WHERE ev.scope_id = $1
  AND (($2::timestamptz IS NULL AND $3::text IS NULL)
       OR (COALESCE(le.window_start, ev.window_start) <= $2 AND $2 < COALESCE(le.window_end, ev.window_end))
       OR le.window_key = $3)
GROUP BY ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement
ORDER BY policy_id, first_decided_at;

-- name: audit_scope_known
-- Whether the ledger or a decision ever named the scope.
SELECT EXISTS (SELECT 1 FROM ledger_entries WHERE scope_id = $1)
    OR EXISTS (SELECT 1 FROM decision_evaluations WHERE scope_id = $1);

-- quotas and pools

-- name: held_concurrency
SELECT run_id, decision_id, tenant, gpus, nodes, sensitive FROM run_holds WHERE state = 'held';

-- name: held_pool_allocations
SELECT namespace, token, levels, project, sub_namespace, run_id, lease_expires_at FROM pool_allocations
WHERE state = 'held' AND lease_expires_at > $1;

-- name: end_run_holds
-- A run's concurrency holds and pool tokens given back; returns the holds ended now (none when
-- they were given back before), with the tenant and sensitive pool they counted against.
WITH tokens AS (
    UPDATE pool_allocations SET state = 'released', released_at = now() WHERE run_id = $1 AND state = 'held'
)
UPDATE run_holds SET state = 'released', ended_at = now() WHERE run_id = $1 AND state = 'held' RETURNING tenant, sensitive;

-- name: reopen_run_holds
-- A run released at its start deadline is running after all: its concurrency holds of decision
-- $2 count again. Returns what they count (none when they are held already, or were never this
-- decision's).
UPDATE run_holds SET state = 'held', ended_at = NULL WHERE run_id = $1 AND decision_id = $2 AND state = 'released'
RETURNING tenant, gpus, nodes, sensitive;

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

-- name: bundle_differs
-- A SHA names one content: re-applying it with other documents is refused.
SELECT documents <> $2::jsonb FROM policy_bundles WHERE git_sha = $1;

-- name: budget_figures
-- Reserved, consumed and whether a hold is in force, for each ledger key of $1 (keys without a
-- ledger entry yet read as nothing used): one round trip for every budget of a bundle.
SELECT k.ledger_key, COALESCE(e.consumed, 0)::bigint AS consumed,
       COALESCE((SELECT SUM(r.amount) FROM reservations r
                 WHERE r.ledger_key = k.ledger_key AND r.state = 'held'), 0)::bigint AS reserved,
       EXISTS (SELECT 1 FROM budget_holds h WHERE h.ledger_key = k.ledger_key) AS held
FROM unnest($1::text[]) AS k (ledger_key) LEFT JOIN ledger_entries e USING (ledger_key);

-- name: bundle_documents
SELECT documents FROM policy_bundles WHERE git_sha = $1;

-- name: decision_inputs
-- A run's latest decision with what it was decided on (explain), and its evaluations' amounts
-- in the ledger's units (policy id -> outcome, limit, projected, remaining, admitted, deficit).
SELECT d.decision_id, d.run_id, d.attempt, d.policy_bundle_sha, d.override_revision, d.request, d.response, d.decided_at, d.readings,
       (SELECT jsonb_object_agg(e.policy_id, jsonb_build_array(e.outcome, e.limit_amount, e.projected, e.remaining, e.admitted, e.deficit))
        FROM decision_evaluations e WHERE e.decision_id = d.decision_id) AS amounts
FROM decisions d WHERE d.run_id = $1 ORDER BY d.attempt DESC LIMIT 1;

-- name: decisions_since
-- Recorded decisions from $1 on, in the order they were made, optionally only those with an
-- evaluation on scope (or policy id) $2 (replay, what-if); amounts as in decision_inputs.
SELECT d.decision_id, d.run_id, d.attempt, d.policy_bundle_sha, d.override_revision, d.request, d.response, d.decided_at, d.readings,
       (SELECT jsonb_object_agg(e.policy_id, jsonb_build_array(e.outcome, e.limit_amount, e.projected, e.remaining, e.admitted, e.deficit))
        FROM decision_evaluations e WHERE e.decision_id = d.decision_id) AS amounts
FROM decisions d
WHERE d.decided_at >= $1
  AND ($2::text IS NULL OR EXISTS (SELECT 1 FROM decision_evaluations e
                                   WHERE e.decision_id = d.decision_id AND (e.scope_id = $2 OR e.policy_id = $2)))
ORDER BY d.decided_at, d.ledger_seq NULLS FIRST, d.decision_id;

-- name: whatif_decision_count
-- How many decisions were recorded from $1 on (what policy what-if's progress counts to).
SELECT count(*) FROM decisions WHERE decided_at >= $1;

-- name: whatif_decisions
-- The submissions recorded from $1 on, in the order decided, with what history decided and the
-- ledger readings each was decided on (policy what-if).
SELECT run_id, attempt, outcome, request, decided_at, readings -> 'ledger' AS ledger
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

-- authenticated callers

-- name: create_api_token
INSERT INTO api_tokens (token_id, name, secret_hash, roles, namespaces, tenants, created_by, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8);

-- name: api_token_by_hash
-- A token that is neither revoked nor expired; the principal it stands for.
SELECT name, roles, namespaces, tenants, expires_at FROM api_tokens
WHERE secret_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now());

-- name: list_api_tokens
SELECT token_id, name, roles, namespaces, tenants, created_by, created_at, expires_at, revoked_at
FROM api_tokens ORDER BY created_at, name;

-- name: revoke_api_token
UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL RETURNING token_id;

-- name: log_admin_action
INSERT INTO admin_log (actor, action, subject, details) VALUES ($1, $2, $3, $4::jsonb);

-- name: admin_log
SELECT actor, action, subject, details, logged_at FROM admin_log ORDER BY id DESC LIMIT $1;

-- name: pool_allocation_principal
-- The row of a held token: who holds it (NULL: granted with a submission, or before tokens had
-- holders), and for which project and sub-namespace.
SELECT principal, project, sub_namespace FROM pool_allocations WHERE namespace = $1 AND token = $2 AND state = 'held' AND lease_expires_at > now();

-- name: lock_pool_token
-- Serialises the allocations of one token of one pool, across processes: what its row says is
-- still so when Redis is asked and the row written.
SELECT pg_advisory_xact_lock(7340, hashtext($1 || chr(9) || $2));

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

-- name: lock_overrides
-- Serialises changes of the override set (API updates, a Git apply) across processes.
SELECT pg_advisory_xact_lock(7320, 0);

-- name: override_revision
SELECT COALESCE(max(revision), 0)::bigint FROM tenant_overrides;

-- name: overrides_at
-- Every tenant's override set as it stood at revision $1.
SELECT DISTINCT ON (tenant) revision, tenant, settings, actor, cause, reason, changed_at
FROM tenant_overrides WHERE revision <= $1 ORDER BY tenant, revision DESC;

-- name: insert_override
-- A tenant's new override set ($2 jsonb), one revision; returns it.
INSERT INTO tenant_overrides (tenant, settings, actor, cause, reason, git_sha) VALUES ($1, $2::jsonb, $3, $4, $5, $6)
RETURNING revision, changed_at;

-- waiting runs and HEADROOM (libs/budgetgate/ledger/waiting.py, services/reconciler/headroom.py) ---

-- name: lock_headroom
-- The judgment locks ($1: names of tenants, the sensitive pool, budgets), all at once, in one
-- order, held to the end of the transaction (services/reconciler/headroom.py).
SELECT count(pg_advisory_xact_lock(7330, k.h)) FROM (SELECT DISTINCT hashtext(n) AS h FROM unnest($1::text[]) AS n ORDER BY 1) AS k;

-- name: waiting_decision
-- A decision as a waiting run needs it: who it was for, what it asked, and its evaluations as
-- [policy id, unit, enforcement, outcome, projected] (core/waiting.py budget_needs).
SELECT d.decision_id, d.run_id, d.attempt, d.outcome, d.reason, d.labels, d.decided_at, d.response ->> 'tenant' AS tenant,
       COALESCE(d.gpus, (d.request -> 'resources' ->> 'gpus')::integer) AS gpus,
       COALESCE(d.nodes, (d.request -> 'resources' ->> 'nodes')::integer, 1) AS nodes,
       COALESCE((SELECT jsonb_agg(jsonb_build_array(e.policy_id, e.unit, e.enforcement, e.outcome, e.projected) ORDER BY e.policy_id)
                 FROM decision_evaluations e WHERE e.decision_id = d.decision_id), '[]'::jsonb) AS evaluations
FROM decisions d WHERE d.decision_id = $1;

-- name: held_by_tenants
-- What each of tenants $1 holds now (Postgres's truth of the quota counters).
SELECT tenant, COALESCE(SUM(gpus), 0)::bigint AS gpus, COALESCE(SUM(nodes), 0)::bigint AS nodes, count(*)::bigint AS allocations
FROM run_holds WHERE state = 'held' AND tenant = ANY($1::text[]) GROUP BY tenant;

-- name: held_sensitive
SELECT COALESCE(SUM(gpus), 0)::bigint AS gpus, COALESCE(SUM(nodes), 0)::bigint AS nodes, count(*)::bigint AS allocations
FROM run_holds WHERE state = 'held' AND sensitive;

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
WHERE NOT EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id;

-- name: waiting_on_release
-- Runs still waiting that a release may concern: for quota headroom of tenant $1 (or, with $2,
-- of the sensitive pool), or on one of policies $3 (a run refused by a quota and a budget waits
-- for quota headroom and needs the budget too, and may be waiting on the budget alone by now).
SELECT w.* FROM waiting_runs w
WHERE ((w.waiting_for = 'quota' AND (w.tenant = $1 OR ($2 AND w.sensitive))) OR w.policy_ids && $3::text[])
  AND NOT EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
ORDER BY w.run_id;

-- name: waiting_unchecked
-- Runs still waiting not yet judged under bundle $1 (a limit may have risen), $2 at a time,
-- claimed so that one reconciler judges each.
SELECT w.* FROM waiting_runs w
WHERE w.checked_sha IS DISTINCT FROM $1
  AND NOT EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = w.run_id AND d.attempt > w.attempt)
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
    -- the LIMIT keeps), by the keys of run_settlements and decisions: never a scan of either.
    SELECT o.uid, o.admitted_at, EXISTS (
        SELECT 1 FROM run_settlements s
        WHERE s.run_id = o.run_id AND (s.final OR s.released) AND s.phase <> 'running' AND s.settled_at < $1
          AND s.decision_id = (SELECT d.decision_id FROM decisions d WHERE d.run_id = o.run_id AND d.outcome = 'ALLOW' ORDER BY d.attempt DESC LIMIT 1)
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
