-- Named queries of budgetgate.messaging (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

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
-- batch ($3 topics, $4 partitions, $5 offsets: one per partition). The rows are named to the
-- outbox's scan too (`o.id = ANY($1)`), so every plan probes each partition's key for them:
-- joined by `o.id = a.id` alone, a plan hashed the acknowledged ids and read the whole outbox,
-- every row published within the replay window, on each pass.
WITH acked AS (
    SELECT a.id, array_agg(DISTINCT a.kafka_partition ORDER BY a.kafka_partition) AS partitions
    FROM unnest($1::bigint[], $2::integer[]) AS a(id, kafka_partition) GROUP BY a.id
), marked AS (
    UPDATE outbox o SET published_at = now(), kafka_partitions = a.partitions
    FROM acked a WHERE o.id = a.id AND o.id = ANY($1::bigint[])
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

-- name: offsets_record
-- What one poll of a consumer tracked by offsets applied: per topic partition ($2, $3), its
-- first and last offsets ($4, $5) and how many records ($6), in the poll's transaction.
INSERT INTO consumer_offsets (consumer, topic, kafka_partition, first_offset, last_offset, records)
SELECT $1, t, p, f, l, n FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[], $6::int[]) AS o(t, p, f, l, n);

-- name: inbox_prune
-- At most `$3` inbox rows of consumer `$1` processed before `$2`; how many went (the caller
-- repeats while a whole slice went, so no one statement holds its locks for long).
WITH gone AS (
    DELETE FROM inbox WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM inbox WHERE consumer = $1 AND processed_at < $2 LIMIT $3
    ))
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: offsets_prune
-- At most `$3` rows of consumer `$1` applied before `$2`, but for the latest of each partition;
-- how many went.
WITH gone AS (
    DELETE FROM consumer_offsets WHERE ctid = ANY(ARRAY(
        SELECT o.ctid FROM consumer_offsets o
        WHERE o.consumer = $1 AND o.applied_at < $2
          AND EXISTS (
              SELECT 1 FROM consumer_offsets n
              WHERE n.consumer = o.consumer AND n.topic = o.topic AND n.kafka_partition = o.kafka_partition AND n.last_offset > o.last_offset
          )
        LIMIT $3
    ))
    RETURNING 1
)
SELECT count(*) FROM gone;

-- metering-ingest ------------------------------------------------------------------------------

