-- What a consumer whose effects are idempotent by the messages' own identity (metering-ingest:
-- a sample's id) has applied, one row per topic partition per poll, written in the poll's
-- transaction with its effects instead of an inbox row per message (budgetgate.messaging.inbox,
-- BatchRoute(offsets=True)). A poll applied again after a crash (its Kafka offsets not yet
-- committed) adds its range again; its effects do not repeat. Rows older than the consumer's
-- retention are pruned, but for the latest of each partition.
--
-- The inbox's rows are pruned after the consumers' retention too (BUDGETGATE_CONSUMER_RETENTION_HOURS;
-- until now they were kept forever), found by a BRIN index on processed_at: the rows arrive in
-- time order, so a few pages of index cover millions of rows, at almost no cost per insert.
CREATE TABLE consumer_offsets (
    consumer        text NOT NULL,
    topic           text NOT NULL,   -- the name in Kafka, deployment prefix included
    kafka_partition integer NOT NULL,
    first_offset    bigint NOT NULL,
    last_offset     bigint NOT NULL,
    records         integer NOT NULL,  -- records of the partition in the poll, duplicates and dead letters included
    applied_at      timestamptz NOT NULL DEFAULT now(),  -- the transaction's start
    CHECK (first_offset <= last_offset AND records > 0)
);
CREATE INDEX consumer_offsets_position ON consumer_offsets (consumer, topic, kafka_partition, last_offset);
CREATE INDEX consumer_offsets_applied ON consumer_offsets (applied_at);
CREATE INDEX inbox_processed ON inbox USING brin (processed_at);
