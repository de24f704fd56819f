-- The inbox of every Kafka consumer: an event id is processed at most once per consumer,
-- recorded in the same transaction as its effect.
CREATE TABLE inbox (
    consumer     text NOT NULL,
    event_id     text NOT NULL,
    topic        text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
