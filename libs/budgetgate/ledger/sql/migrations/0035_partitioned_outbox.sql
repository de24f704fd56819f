-- 0035_partitioned_outbox: the outbox partitioned by the UTC month of created_at, as decisions
-- (0033) and usage records (0034) are by their times. Rows published longer ago than the replay
-- window are still pruned a batch at a time by every relay (what keeps the table small between
-- months); a month past the retention is archived (any row left in it is written to a file) and
-- its partition dropped by `budgetgate ledger archive`, refused while it holds a row not yet
-- published.
--
-- No default partition: created_at is Postgres's own clock (its default), so a row outside the
-- months created ahead can only come of months not created (services create them on start and
-- hourly, `budgetgate ledger partitions` by hand), and is refused with Postgres's error naming the
-- outbox and the instant. Without one, a month is detached CONCURRENTLY: every relay goes on
-- claiming and marking rows while it is.
--
-- The primary key holds created_at (a partitioned table's unique keys hold its partition key);
-- the id, from the same sequence as before, stays unique by itself. The rows are copied into the
-- new table (a few minutes' worth, the rest was pruned).
ALTER TABLE outbox RENAME TO outbox_0034;
ALTER TABLE outbox_0034 DROP CONSTRAINT outbox_pkey;
DROP INDEX outbox_pending, outbox_published;

CREATE TABLE outbox (
    id           bigint NOT NULL DEFAULT nextval('outbox_id_seq'),
    topic        text NOT NULL,
    key          text,
    payload      bytea,
    headers      jsonb NOT NULL DEFAULT '[]',
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    records      integer NOT NULL DEFAULT 1,
    keys         text[],
    payloads     bytea[],
    event_ids    text[],
    kafka_partitions integer[],
    CONSTRAINT outbox_pkey PRIMARY KEY (id, created_at),
    CONSTRAINT outbox_record_or_bundle CHECK (
        CASE WHEN payloads IS NULL THEN payload IS NOT NULL AND records = 1 AND keys IS NULL AND event_ids IS NULL
             ELSE payload IS NULL AND key IS NULL AND records >= 1 AND cardinality(payloads) = records
                  AND cardinality(keys) = records AND cardinality(event_ids) = records END
    )
) PARTITION BY RANGE (created_at);
ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;
CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
-- As 0026 made them: lz4 where the server has it, for the partitions made from the table.
DO $$
BEGIN
    ALTER TABLE outbox ALTER COLUMN payloads SET COMPRESSION lz4,
                       ALTER COLUMN keys SET COMPRESSION lz4,
                       ALTER COLUMN event_ids SET COMPRESSION lz4,
                       ALTER COLUMN payload SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no lz4: the outbox keeps pglz';
END
$$;

SELECT budgetgate_ensure_month('outbox', m.month)
FROM (SELECT DISTINCT date_trunc('month', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month FROM outbox_0034) AS m;
SELECT budgetgate_ensure_partitions('outbox', 3);
INSERT INTO outbox (id, topic, key, payload, headers, created_at, published_at, records, keys, payloads, event_ids, kafka_partitions)
SELECT id, topic, key, payload, headers, created_at, published_at, records, keys, payloads, event_ids, kafka_partitions FROM outbox_0034;
DROP TABLE outbox_0034;
