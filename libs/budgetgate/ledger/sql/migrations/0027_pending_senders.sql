-- 0027_pending_senders: a sample kept pending (its run had no decision yet) keeps the sender that
-- posted it when that sender is limited to namespaces or tenants (an exporter token's limits):
-- once the run has a decision, the sample is applied only if the run is within them, else it is
-- dead-lettered as out_of_scope. '' and no limits: a sender not limited (a token without limits,
-- or Kafka). A limited sender's sample is kept beside one of the same id from another sender,
-- not instead of it, so no sender can take a sample id of another's run first.
ALTER TABLE metering_pending
    ADD COLUMN sender            text NOT NULL DEFAULT '',
    ADD COLUMN sender_namespaces text[] NOT NULL DEFAULT '{}',
    ADD COLUMN sender_tenants    text[] NOT NULL DEFAULT '{}',
    DROP CONSTRAINT metering_pending_pkey,
    ADD PRIMARY KEY (run_id, sample_id, sender);
