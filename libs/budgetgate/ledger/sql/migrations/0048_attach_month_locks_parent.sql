-- 0048_attach_month_locks_parent: moving a month's rows out of a default partition no longer
-- hides them from a statement running meanwhile.
--
-- A statement reads a partitioned table's list of partitions when it is planned. One planned
-- while the upkeep (budgetgate.ledger.partitions.ensure) created a month and moved that month's
-- rows out of the default partition, and blocked on the default partition's lock, resumed after
-- the move with the list from before it: the rows were gone from the default partition and the
-- new partition was not in its plan, so it counted none of them (a chargeback report asked for
-- that month answered nothing reserved). When the default partition holds rows of the month, the
-- parent is now locked first, in ACCESS EXCLUSIVE mode: statements wait before they are planned
-- and are planned with the new partition. The parent's lock is taken only then (rows of a month
-- without a partition are rare: a clock far off, a late sample), so creating the months ahead,
-- the usual case, takes no more lock than before, whatever other months the default partition
-- holds; a move waits for the statements in flight on the table and holds new ones back while it
-- runs (ensure's lock_timeout bounds the wait).
CREATE OR REPLACE FUNCTION budgetgate_attach_month(p_parent text, p_table text, p_at timestamptz) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    first_day timestamp := date_trunc('month', p_at AT TIME ZONE 'UTC');
    lo timestamptz := first_day AT TIME ZONE 'UTC';
    hi timestamptz := (first_day + interval '1 month') AT TIME ZONE 'UTC';
    key text;
    fallback regclass;
    cols text;
    waiting boolean;
    moved bigint := 0;
BEGIN
    SELECT a.attname, NULLIF(pt.partdefid, 0)::regclass INTO key, fallback
    FROM pg_partitioned_table pt JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = p_parent::regclass;
    IF key IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table', p_parent;
    END IF;
    IF fallback IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE %I >= $1 AND %I < $2)', fallback, key, key) INTO waiting USING lo, hi;
        IF waiting THEN  -- the parent before its partition, the order every statement locks them in
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', p_parent);
        END IF;
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', fallback);
        SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO cols
        FROM pg_attribute a WHERE a.attrelid = p_parent::regclass AND a.attnum > 0 AND NOT a.attisdropped;
        EXECUTE format('WITH moved AS (DELETE FROM %s WHERE %I >= $1 AND %I < $2 RETURNING %s) INSERT INTO %I (%s) SELECT %s FROM moved',
                       fallback, key, key, cols, p_table, cols, cols) USING lo, hi;
        GET DIAGNOSTICS moved = ROW_COUNT;
    END IF;
    EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', p_parent, p_table, lo, hi);
    RETURN moved;
END
$$;
