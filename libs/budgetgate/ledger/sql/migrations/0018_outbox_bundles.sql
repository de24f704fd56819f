-- 0018_outbox_bundles: an outbox row may carry a bundle, several records of one topic written by
-- one transaction (metering-ingest's usage records of a Kafka poll), instead of one record: one
-- row to write, claim and mark for a whole poll instead of one per sample (issue 9). A bundle's
-- records share their headers (`headers`) but for the event id (`event_ids`); `records` counts
-- what a row carries, so a relay claims up to a number of records. A published row keeps every
-- partition its records went to (`kafka_partitions`, which replaces `kafka_partition`): a
-- partition that lost records gets every row that went to it sent again.

ALTER TABLE outbox ALTER COLUMN payload DROP NOT NULL;
ALTER TABLE outbox
    ADD COLUMN records integer NOT NULL DEFAULT 1,
    ADD COLUMN keys text[],
    ADD COLUMN payloads bytea[],
    ADD COLUMN event_ids text[],
    ADD COLUMN kafka_partitions integer[];
UPDATE outbox SET kafka_partitions = ARRAY[kafka_partition] WHERE kafka_partition IS NOT NULL;
ALTER TABLE outbox DROP COLUMN kafka_partition;
ALTER TABLE outbox ADD CONSTRAINT outbox_record_or_bundle CHECK (
    CASE WHEN payloads IS NULL THEN payload IS NOT NULL AND records = 1 AND keys IS NULL AND event_ids IS NULL
         ELSE payload IS NULL AND key IS NULL AND records >= 1 AND cardinality(payloads) = records
              AND cardinality(keys) = records AND cardinality(event_ids) = records END
);
