-- 0042: a decision's documents (its request, answer and readings) compressed with lz4 rather
-- than pglz, as 0026 did for the outbox: a decision's row (about 2.7 kB) is over the size at
-- which Postgres compresses it, on the path every decision's answer waits behind. Measured by
-- inserting 20,000 rows with a 1.9 kB answer: 940 ms with pglz, 727 ms with lz4 (about 10 µs a
-- row), at 386 and 422 bytes stored. Every partition made since 0033 and the parent, from which
-- later partitions take it (budgetgate_ensure_month: LIKE ... INCLUDING COMPRESSION). A server
-- built without lz4 keeps pglz.
DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT relid FROM pg_partition_tree('decisions') LOOP
        EXECUTE format('ALTER TABLE %s ALTER COLUMN request SET COMPRESSION lz4, ALTER COLUMN response SET COMPRESSION lz4, '
                       'ALTER COLUMN readings SET COMPRESSION lz4', part);
    END LOOP;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no lz4: decisions keep pglz';
END
$$;
