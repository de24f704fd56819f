-- 0033_partitioned_decisions: decisions and their evaluations partitioned by month of decided_at,
-- so a month older than the retention is archived to a file and its partitions detached and
-- dropped (`budgetgate ledger archive`, budgetgate.ledger.archive) instead of deleted row by row.
--
-- A month's partition is `<table>_pYYYYMM`, holding [the first of the month, the first of the
-- next) in UTC; `<table>_default` takes a row of any month without one (a clock far off, a
-- month not created yet), so no write ever fails for want of a partition, and the next
-- `budgetgate_ensure_partitions` moves such rows into their month's partition. Months are created
-- ahead: here, on every service's start and by the reconciler (budgetgate.ledger.partitions).
--
-- What a partitioned table cannot enforce across its partitions, unless decided_at is part of
-- it, moves to `decision_keys`, one narrow row per decision kept when its month is archived:
-- that a run's attempt is decided once, that a ledger sequence number is recorded once (0021),
-- and the decision every reservation, concurrency hold, settlement and evaluation refers to
-- (their foreign keys now point at it). A trigger writes a decision's keys as the decision is
-- written, whoever writes it; keys never change afterwards. A run whose latest decision is
-- archived is known by them: a resend is answered 410 Gone, explain names the archive.
--
-- Every decision and evaluation is copied into the new tables (the evaluations gain decided_at,
-- their decision's, to be partitioned alike): a rewrite of both tables under ACCESS EXCLUSIVE,
-- admission waits (docs/operations.md, "Upgrades").

-- The months archived: their partitions are gone, their rows in the files the manifest names.
CREATE TABLE ledger_archives (
    partition   text PRIMARY KEY,
    parent      text NOT NULL,
    range_start timestamptz NOT NULL,
    range_end   timestamptz NOT NULL,
    row_count   bigint NOT NULL,
    sha256      text NOT NULL,          -- of the compressed file
    location    text NOT NULL,          -- the archive's manifest, as the archiving command wrote it
    archived_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_archives_range ON ledger_archives (parent, range_start);

-- The partition of `p_parent` that holds instant `p_at`: `<parent>_pYYYYMM` (the UTC month).
CREATE FUNCTION budgetgate_partition_name(p_parent text, p_at timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT p_parent || '_p' || to_char(p_at AT TIME ZONE 'UTC', 'YYYYMM')
$$;

-- Attaches table `p_table` (shaped as `p_parent`) as the partition of the UTC month of `p_at`,
-- first moving into it the rows of that month the default partition holds (which would
-- otherwise refuse the attach). Returns how many rows were moved. The default partition is
-- locked for the move and the attach (the attach takes that lock anyway).
CREATE FUNCTION budgetgate_attach_month(p_parent text, p_table text, p_at timestamptz) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    first_day timestamp := date_trunc('month', p_at AT TIME ZONE 'UTC');
    lo timestamptz := first_day AT TIME ZONE 'UTC';
    hi timestamptz := (first_day + interval '1 month') AT TIME ZONE 'UTC';
    key text;
    fallback regclass;
    cols text;
    moved bigint := 0;
BEGIN
    SELECT a.attname, NULLIF(pt.partdefid, 0)::regclass INTO key, fallback
    FROM pg_partitioned_table pt JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = p_parent::regclass;
    IF key IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table', p_parent;
    END IF;
    IF fallback IS NOT NULL THEN
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

-- Creates the partition of `p_parent` for the UTC month of `p_at` unless it exists or that month
-- was archived; true when it was created.
CREATE FUNCTION budgetgate_ensure_month(p_parent text, p_at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    name text := budgetgate_partition_name(p_parent, p_at);
BEGIN
    IF to_regclass(name) IS NOT NULL OR EXISTS (SELECT 1 FROM ledger_archives a WHERE a.partition = name) THEN
        RETURN false;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMPRESSION)', name, p_parent);
    PERFORM budgetgate_attach_month(p_parent, name, p_at);
    RETURN true;
END
$$;

-- The partitions of `p_parent` for this UTC month and the `p_ahead` after it, and for every
-- month (not archived) of which the default partition holds rows, those rows moved into it.
-- Returns the partitions created. One caller per table at a time (an advisory lock).
CREATE FUNCTION budgetgate_ensure_partitions(p_parent text, p_ahead integer) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    this_month timestamp := date_trunc('month', now() AT TIME ZONE 'UTC');
    month timestamp;
    key text;
    fallback regclass;
BEGIN
    PERFORM pg_advisory_xact_lock(7350, hashtext(p_parent));
    FOR month IN SELECT generate_series(this_month, this_month + make_interval(months => p_ahead), interval '1 month') LOOP
        IF budgetgate_ensure_month(p_parent, month AT TIME ZONE 'UTC') THEN
            RETURN NEXT budgetgate_partition_name(p_parent, month AT TIME ZONE 'UTC');
        END IF;
    END LOOP;
    SELECT a.attname, NULLIF(pt.partdefid, 0)::regclass INTO key, fallback
    FROM pg_partitioned_table pt JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = p_parent::regclass;
    IF fallback IS NOT NULL THEN
        FOR month IN EXECUTE format('SELECT DISTINCT date_trunc(''month'', %I AT TIME ZONE ''UTC'') FROM %s ORDER BY 1', key, fallback) LOOP
            IF budgetgate_ensure_month(p_parent, month AT TIME ZONE 'UTC') THEN
                RETURN NEXT budgetgate_partition_name(p_parent, month AT TIME ZONE 'UTC');
            END IF;
        END LOOP;
    END IF;
END
$$;

-- The keys of every decision, archived or not.
CREATE TABLE decision_keys (
    decision_id uuid PRIMARY KEY,
    run_id      text NOT NULL,
    attempt     integer NOT NULL,
    outcome     text NOT NULL,
    decided_at  timestamptz NOT NULL,
    ledger_seq  bigint,
    CONSTRAINT decision_keys_run_attempt UNIQUE (run_id, attempt)
);
INSERT INTO decision_keys (decision_id, run_id, attempt, outcome, decided_at, ledger_seq)
SELECT decision_id, run_id, attempt, outcome, decided_at, ledger_seq FROM decisions;
-- A ledger sequence number is recorded once; numbers recorded twice before 0021 stay, and the
-- unique index covers the numbers above the highest of them, as 0021 made it on decisions. It
-- keeps its name (a unique violation of decisions_ledger_seq tells admission Redis lost writes).
DROP INDEX decisions_ledger_seq;
DROP INDEX IF EXISTS decisions_ledger_seq_reused;
DO $$
DECLARE
    highest bigint;
BEGIN
    SELECT max(d.ledger_seq) INTO highest
    FROM (SELECT ledger_seq FROM decision_keys WHERE ledger_seq IS NOT NULL GROUP BY ledger_seq HAVING count(*) > 1) AS d;
    IF highest IS NULL THEN
        CREATE UNIQUE INDEX decisions_ledger_seq ON decision_keys (ledger_seq) WHERE ledger_seq IS NOT NULL;
    ELSE
        EXECUTE format('CREATE UNIQUE INDEX decisions_ledger_seq ON decision_keys (ledger_seq) WHERE ledger_seq > %s', highest);
        CREATE INDEX decisions_ledger_seq_reused ON decision_keys (ledger_seq) WHERE ledger_seq IS NOT NULL;
    END IF;
END
$$;

ALTER TABLE reservations DROP CONSTRAINT reservations_decision_id_fkey,
    ADD CONSTRAINT reservations_decision_id_fkey FOREIGN KEY (decision_id) REFERENCES decision_keys (decision_id);
ALTER TABLE run_settlements DROP CONSTRAINT run_settlements_decision_id_fkey,
    ADD CONSTRAINT run_settlements_decision_id_fkey FOREIGN KEY (decision_id) REFERENCES decision_keys (decision_id);
ALTER TABLE run_holds DROP CONSTRAINT run_holds_decision_id_fkey,
    ADD CONSTRAINT run_holds_decision_id_fkey FOREIGN KEY (decision_id) REFERENCES decision_keys (decision_id);

-- The tables as they were, emptied into the partitioned ones below and dropped; their views
-- are made again on the new tables.
DROP VIEW audit_denial_rate, audit_window_exhaustion, audit_decisions_by_policy_sha;
ALTER TABLE decision_evaluations RENAME TO decision_evaluations_0032;
ALTER TABLE decision_evaluations_0032 DROP CONSTRAINT decision_evaluations_pkey, DROP CONSTRAINT decision_evaluations_decision_id_fkey;
DROP INDEX decision_evaluations_scope;
ALTER TABLE decisions RENAME TO decisions_0032;
ALTER TABLE decisions_0032 DROP CONSTRAINT decisions_pkey, DROP CONSTRAINT decisions_run_id_attempt_key;
DROP INDEX decisions_decided_at;

CREATE TABLE decisions (
    decision_id       uuid NOT NULL,
    run_id            text NOT NULL,
    attempt           integer NOT NULL CONSTRAINT decisions_attempt_check CHECK (attempt >= 1),
    outcome           text NOT NULL CONSTRAINT decisions_outcome_check CHECK (outcome IN ('ALLOW', 'DENY', 'DELAY')),
    reason            text NOT NULL,
    namespace         text NOT NULL,
    labels            jsonb NOT NULL,
    job_namespace     text,
    job_name          text,
    policy_bundle_sha text,
    projected_gpu     bigint NOT NULL,
    showback_micros   bigint,
    currency          text,
    request           jsonb NOT NULL,
    response          jsonb NOT NULL,
    decided_at        timestamptz NOT NULL,
    ledger_seq        bigint,
    gpus              integer,
    nodes             integer,
    flavor            text,
    region            text,
    readings          jsonb,
    override_revision bigint,
    PRIMARY KEY (decision_id, decided_at)
) PARTITION BY RANGE (decided_at);
CREATE INDEX decisions_run ON decisions (run_id, attempt);
CREATE INDEX decisions_decided_at ON decisions (decided_at);
CREATE TABLE decisions_default PARTITION OF decisions DEFAULT;

CREATE TABLE decision_evaluations (
    decision_id        uuid NOT NULL REFERENCES decision_keys (decision_id),
    policy_id          text NOT NULL,
    policy_git_sha     text NOT NULL,
    scope_id           text NOT NULL,
    ledger_key         text,
    window_start       timestamptz,
    window_end         timestamptz,
    unit               text NOT NULL,
    enforcement        text NOT NULL,
    outcome            text NOT NULL,
    limit_amount       bigint NOT NULL,
    projected          bigint NOT NULL,
    remaining          bigint,
    admitted           bigint NOT NULL,
    deficit            bigint,
    next_eligible_time timestamptz,
    decided_at         timestamptz NOT NULL,
    PRIMARY KEY (decision_id, policy_id, decided_at)
) PARTITION BY RANGE (decided_at);
CREATE INDEX decision_evaluations_scope ON decision_evaluations (scope_id, window_start);
CREATE TABLE decision_evaluations_default PARTITION OF decision_evaluations DEFAULT;

-- A partition for every month with decisions, then the months ahead; the rows copied in.
SELECT budgetgate_ensure_month(t.parent, m.month)
FROM (SELECT DISTINCT date_trunc('month', decided_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS month FROM decisions_0032) AS m,
     (VALUES ('decisions'), ('decision_evaluations')) AS t (parent);
SELECT budgetgate_ensure_partitions('decisions', 3);
SELECT budgetgate_ensure_partitions('decision_evaluations', 3);
INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name, policy_bundle_sha,
                       projected_gpu, showback_micros, currency, request, response, decided_at, ledger_seq, gpus, nodes, flavor, region,
                       readings, override_revision)
SELECT decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name, policy_bundle_sha,
       projected_gpu, showback_micros, currency, request, response, decided_at, ledger_seq, gpus, nodes, flavor, region,
       readings, override_revision
FROM decisions_0032;
INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, window_start, window_end, unit, enforcement,
                                  outcome, limit_amount, projected, remaining, admitted, deficit, next_eligible_time, decided_at)
SELECT e.decision_id, e.policy_id, e.policy_git_sha, e.scope_id, e.ledger_key, e.window_start, e.window_end, e.unit, e.enforcement,
       e.outcome, e.limit_amount, e.projected, e.remaining, e.admitted, e.deficit, e.next_eligible_time, d.decided_at
FROM decision_evaluations_0032 e JOIN decisions_0032 d USING (decision_id);
DROP TABLE decision_evaluations_0032, decisions_0032;

-- A decision's keys, written as the decision is (so a second decision of a run's attempt, or a
-- second use of a ledger sequence number, fails its insert), and never changed after.
CREATE FUNCTION budgetgate_decision_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'a decision''s keys (decision_id, run_id, attempt, outcome, decided_at, ledger_seq) never change: decision %', OLD.decision_id;
    END IF;
    INSERT INTO decision_keys (decision_id, run_id, attempt, outcome, decided_at, ledger_seq)
    VALUES (NEW.decision_id, NEW.run_id, NEW.attempt, NEW.outcome, NEW.decided_at, NEW.ledger_seq);
    RETURN NEW;
END
$$;
CREATE TRIGGER decisions_keys BEFORE INSERT ON decisions FOR EACH ROW EXECUTE FUNCTION budgetgate_decision_keys();
CREATE TRIGGER decisions_keys_fixed BEFORE UPDATE OF decision_id, run_id, attempt, outcome, decided_at, ledger_seq ON decisions
    FOR EACH ROW WHEN (ROW(OLD.decision_id, OLD.run_id, OLD.attempt, OLD.outcome, OLD.decided_at, OLD.ledger_seq)
                       IS DISTINCT FROM ROW(NEW.decision_id, NEW.run_id, NEW.attempt, NEW.outcome, NEW.decided_at, NEW.ledger_seq))
    EXECUTE FUNCTION budgetgate_decision_keys();

-- Read from the keys: the highest number survives its decision's archiving.
CREATE OR REPLACE FUNCTION budgetgate_committed_ledger_seq() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT GREATEST(COALESCE((SELECT max(k.ledger_seq) FROM decision_keys k WHERE k.ledger_seq IS NOT NULL), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m), 0))::bigint
$$;

-- Each run's latest decision found by its keys (one index probe) and read from its month's
-- partition; a run whose latest decision is archived comes back with its attempt and
-- decided_at and no outcome, request or response (admission answers a resend 410 Gone).
DROP FUNCTION budgetgate_begin_batch(text[]);
CREATE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7301, 0);
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(7302, lock_key);
    END LOOP;
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               budgetgate_committed_ledger_seq(),
               GREATEST(COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0),
                        COALESCE((SELECT max(g.revision) FROM budget_grants g), 0))::bigint,
               NULL::timestamptz;
    RETURN QUERY
        SELECT k.run_id, k.decision_id, k.attempt, x.outcome, x.request, x.response, NULL::bigint, NULL::bigint, k.decided_at
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT y.run_id, y.decision_id, y.attempt, y.decided_at FROM decision_keys y
                            WHERE y.run_id = ids.id ORDER BY y.attempt DESC LIMIT 1) AS k
        LEFT JOIN LATERAL (SELECT d.outcome, d.request, d.response FROM decisions d
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at) AS x ON true
        ORDER BY k.run_id;
END
$$;

CREATE VIEW audit_denial_rate AS
WITH latest AS (
    SELECT DISTINCT ON (run_id) decision_id, decided_at, run_id, outcome
    FROM decisions ORDER BY run_id, attempt DESC
)
SELECT ev.scope_id,
       le.window_key,
       le.window_start,
       le.window_end,
       count(DISTINCT l.run_id)                                      AS runs,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'ALLOW')   AS allowed,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DENY')    AS denied,
       count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DELAY')   AS delayed,
       round(count(DISTINCT l.run_id) FILTER (WHERE l.outcome = 'DENY')::numeric
             / count(DISTINCT l.run_id), 4)                         AS denial_rate
FROM latest l
JOIN decision_evaluations ev ON ev.decision_id = l.decision_id AND ev.decided_at = l.decided_at
LEFT JOIN ledger_entries le ON le.ledger_key = ev.ledger_key
GROUP BY ev.scope_id, le.window_key, le.window_start, le.window_end;

CREATE VIEW audit_window_exhaustion AS
WITH figures AS (
    SELECT e.ledger_key, e.scope_id, e.policy_id, e.policy_git_sha, e.unit, e.window_key,
           e.window_start, e.window_end, e.limit_amount, e.consumed,
           COALESCE(SUM(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint AS reserved
    FROM ledger_entries e LEFT JOIN reservations r ON r.ledger_key = e.ledger_key
    WHERE e.window_start IS NOT NULL
    GROUP BY e.ledger_key
), ran_out AS (
    SELECT ev.ledger_key, min(ev.decided_at) AS exhausted_at
    FROM decision_evaluations ev
    WHERE ev.remaining IS NOT NULL AND ev.remaining - ev.admitted <= 0
    GROUP BY ev.ledger_key
), burn AS (
    SELECT f.*, f.consumed + f.reserved AS used,
           extract(epoch FROM least(now(), f.window_end) - f.window_start) AS elapsed_seconds
    FROM figures f
)
SELECT b.ledger_key, b.scope_id, b.policy_id, b.policy_git_sha, b.unit, b.window_key,
       b.window_start, b.window_end, b.limit_amount, b.used,
       CASE WHEN b.elapsed_seconds > 0 THEN round(b.used * 3600 / b.elapsed_seconds) END::bigint AS burn_per_hour,
       o.exhausted_at,
       CASE WHEN o.exhausted_at IS NULL AND b.used > 0 AND b.used < b.limit_amount AND b.elapsed_seconds > 0
                 AND now() < b.window_end
                 AND b.window_start + make_interval(secs => b.limit_amount * b.elapsed_seconds / b.used) < b.window_end
            THEN b.window_start + make_interval(secs => b.limit_amount * b.elapsed_seconds / b.used)
       END AS projected_exhaustion_at
FROM burn b LEFT JOIN ran_out o ON o.ledger_key = b.ledger_key;

CREATE VIEW audit_decisions_by_policy_sha AS
SELECT ev.policy_id,
       ev.policy_git_sha,
       ev.scope_id,
       ev.enforcement,
       count(*)                                       AS decisions,
       count(*) FILTER (WHERE ev.outcome = 'ALLOW')   AS allowed,
       count(*) FILTER (WHERE ev.outcome = 'DENY')    AS denied,
       count(*) FILTER (WHERE ev.outcome = 'DELAY')   AS delayed,
       min(ev.decided_at)                             AS first_decided_at,
       max(ev.decided_at)                             AS last_decided_at
FROM decision_evaluations ev
GROUP BY ev.policy_id, ev.policy_git_sha, ev.scope_id, ev.enforcement;

-- The runs the ledger still works on, each with why (a run may show up once per reason): their
-- decisions and usage are not archived (budgetgate.ledger.archive). A run holding nothing, ended
-- and settled to its end, is not here.
CREATE VIEW ledger_open_runs AS
SELECT run_id, 'a reservation is held' AS reason FROM reservations WHERE state = 'held'
UNION ALL SELECT run_id, 'a concurrency hold is held' FROM run_holds WHERE state = 'held'
UNION ALL SELECT run_id, 'a provisional hold is open' FROM provisional_holds
UNION ALL SELECT run_id, 'it waits for room (DELAY or quota)' FROM waiting_runs
UNION ALL SELECT run_id, 'it is not settled to its end' FROM run_settlements WHERE NOT ((final OR released) AND phase <> 'running')
UNION ALL SELECT run_id, 'it has facts waiting to be settled' FROM runs_to_settle
UNION ALL SELECT run_id, 'its settlement failed and is being retried' FROM settlement_failures WHERE NOT dead;
