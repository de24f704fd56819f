-- 0011_outbox_replay: published outbox rows stay for a replay window, with the partition the
-- broker put each one in, and the relays remember the highest offset each partition
-- acknowledged. A partition that later ends at or below that offset has lost acknowledged
-- records (a broker without durable storage restarted, a cluster restored from an older
-- state), and the rows published to it within the window are sent again.

ALTER TABLE outbox ADD COLUMN kafka_partition integer;
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;

CREATE TABLE outbox_watermarks (
    topic           text NOT NULL,   -- the name in Kafka, deployment prefix included
    kafka_partition integer NOT NULL,
    acked_offset    bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, kafka_partition)
);
