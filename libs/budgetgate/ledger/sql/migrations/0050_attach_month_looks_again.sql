-- 0050: a month's partition is never made with rows moved behind a waiting statement's back.
--
-- budgetgate_attach_month looks for the month's rows in the default partition before it locks
-- it, and locks the parent first only when it finds some (0048). A row of the month committed
-- between that look and the default partition's lock (its writer held the partition, so the lock
-- waited for the writer) was moved without the parent's lock: a statement planned meanwhile,
-- queued behind the lock, resumed with the partitions from before the move and counted none of
-- it. Once it holds the default partition the function looks again; rows found only then make
-- it give up with lock_not_available and nothing changed, as a busy table does, and the next try
-- (budgetgate.ledger.partitions.ensure_quietly's, the next hour's) takes the parent's lock first.
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
        -- 0050: rows of the month committed between the look above and this lock (their writer
        -- held the default partition, so the lock waited for it) would be moved without the
        -- parent's lock, behind the back of a statement planned meanwhile. Nothing is changed
        -- yet: give up, as a busy table does, and the next try takes the parent's lock first.
        IF NOT waiting THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE %I >= $1 AND %I < $2)', fallback, key, key) INTO waiting USING lo, hi;
            IF waiting THEN
                RAISE EXCEPTION 'rows of % arrived in % while its partition was being made; the next try moves them', to_char(first_day, 'YYYY-MM'), fallback
                    USING ERRCODE = 'lock_not_available';
            END IF;
        END IF;
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
