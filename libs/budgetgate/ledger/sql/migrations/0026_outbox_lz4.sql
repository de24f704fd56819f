-- 0026_outbox_lz4: the outbox's bundle columns compressed with lz4 rather than pglz. A bundle of
-- a metering poll (5,000 usage records, about 0.8 MB) is written inside the poll's transaction,
-- on the path every later poll waits behind: written eight times, such a bundle took 23-44 ms
-- with pglz and 8-12 ms with lz4, to much the same size. A server built without lz4 keeps pglz.
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
