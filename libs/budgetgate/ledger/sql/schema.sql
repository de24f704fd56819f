-- The whole current schema in one file, for reading and for the drift test: a database built
-- from it must equal one built from the numbered migrations. Update it with every migration.
-- Amounts are bigint in fixed-point units (milli-unit-seconds; micro-currency for cost).

CREATE TABLE policy_bundles (
    git_sha     text PRIMARY KEY,
    documents   jsonb NOT NULL,
    source      text NOT NULL,
    applied_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The active bundle is the latest activation; re-applying an older SHA activates it again.
CREATE TABLE policy_activations (
    seq          bigserial PRIMARY KEY,
    git_sha      text NOT NULL REFERENCES policy_bundles (git_sha),
    activated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE ledger_entries (
    ledger_key     text PRIMARY KEY,
    scope_id       text NOT NULL,
    unit           text NOT NULL CHECK (unit IN ('gpu_hours', 'node_hours', 'wall_hours', 'cost')),
    window_key     text NOT NULL,
    window_start   timestamptz,          -- NULL for rolling windows
    window_end     timestamptz,
    policy_id      text NOT NULL,
    policy_git_sha text NOT NULL,
    limit_amount   bigint NOT NULL CHECK (limit_amount >= 0),
    consumed       bigint NOT NULL DEFAULT 0 CHECK (consumed >= 0),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_entries_scope ON ledger_entries (scope_id, window_start);
CREATE INDEX ledger_entries_policy ON ledger_entries (policy_id);

-- 0033: decisions and their evaluations are partitioned by the UTC month of decided_at
-- (`<table>_pYYYYMM`, created ahead by budgetgate_ensure_partitions; `<table>_default` takes a
-- row of a month without one), so a month older than the retention is archived to files and
-- its partitions dropped (`budgetgate ledger archive`). What a partitioned table cannot enforce
-- across partitions lives in decision_keys, one narrow row per decision, kept when its month is
-- archived: a run's attempt decided once, a ledger sequence number recorded once (0021), and the
-- decision the foreign keys of reservations, holds, settlements and evaluations point at.

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
-- locked for the move and the attach (the attach takes that lock anyway); when it holds rows of
-- the month, the parent first, so no statement planned before the move reads without them (0048);
-- rows of the month that arrive in between make it give up, nothing changed (0050).
CREATE FUNCTION budgetgate_attach_month(p_parent text, p_table text, p_at timestamptz) RETURNS bigint
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
-- 0021, 0033: unique, so a number a Redis that lost writes hands out again fails the second commit
-- (the index kept its name from when it was on decisions: admission looks for it).
CREATE UNIQUE INDEX decisions_ledger_seq ON decision_keys (ledger_seq) WHERE ledger_seq IS NOT NULL;

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
    response          jsonb NOT NULL,   -- the answer as first given; replays return it
    decided_at        timestamptz NOT NULL,
    ledger_seq        bigint,           -- 0009: Redis's ledger sequence after this decision reserved
    gpus              integer,          -- 0009: the run's resources, typed
    nodes             integer,
    flavor            text,
    region            text,
    readings          jsonb,            -- 0014: what the decision was made on; NULL before 0014
    override_revision bigint,           -- 0015: the tenant override revision it was made under
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
    ledger_key         text,             -- NULL when a label violation denied before any ledger
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
    decided_at         timestamptz NOT NULL,  -- 0033: its decision's, to be partitioned alike
    PRIMARY KEY (decision_id, policy_id, decided_at)
) PARTITION BY RANGE (decided_at);
CREATE INDEX decision_evaluations_scope ON decision_evaluations (scope_id, window_start);
CREATE TABLE decision_evaluations_default PARTITION OF decision_evaluations DEFAULT;
SELECT budgetgate_ensure_partitions('decisions', 3);
SELECT budgetgate_ensure_partitions('decision_evaluations', 3);

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

CREATE TABLE reservations (
    run_id         text NOT NULL,
    ledger_key     text NOT NULL,        -- a ledger_entries key, written in the same statement
    decision_id    uuid NOT NULL REFERENCES decision_keys (decision_id),
    amount         bigint NOT NULL CHECK (amount >= 0),
    state          text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released', 'reconciled')),
    expected_end   timestamptz NOT NULL,  -- submission time + projected runtime
    created_at     timestamptz NOT NULL DEFAULT now(),
    ended_at       timestamptz,
    end_reason     text,
    PRIMARY KEY (run_id, ledger_key)
);
CREATE INDEX reservations_held ON reservations (ledger_key, expected_end) WHERE state = 'held';

-- Transactional outbox: written with the decision, published to Kafka by a relay. A row holds
-- one record (key, payload, headers) or, since 0018, a bundle of records of one topic (keys,
-- payloads, event_ids, sharing `headers` but for the event id). 0035: partitioned by the UTC
-- month of created_at, without a default partition (created_at is Postgres's clock), so a month
-- is detached CONCURRENTLY when archived; the key holds created_at, the id stays unique alone.
CREATE TABLE outbox (
    id           bigserial,
    topic        text NOT NULL,           -- logical topic name, without any deployment prefix
    key          text,
    payload      bytea,
    headers      jsonb NOT NULL DEFAULT '[]',
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    records      integer NOT NULL DEFAULT 1,  -- 0018: how many records the row carries
    keys         text[],
    payloads     bytea[],
    event_ids    text[],
    kafka_partitions integer[],           -- where the broker put its records, for a replay
    CONSTRAINT outbox_pkey PRIMARY KEY (id, created_at),
    CONSTRAINT outbox_record_or_bundle CHECK (
        CASE WHEN payloads IS NULL THEN payload IS NOT NULL AND records = 1 AND keys IS NULL AND event_ids IS NULL
             ELSE payload IS NULL AND key IS NULL AND records >= 1 AND cardinality(payloads) = records
                  AND cardinality(keys) = records AND cardinality(event_ids) = records END
    )
) PARTITION BY RANGE (created_at);
CREATE INDEX outbox_pending ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
-- 0026: the records' columns compressed with lz4, not pglz (a metering poll's bundle is written
-- on the path later polls wait behind); a server built without lz4 keeps pglz.
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
SELECT budgetgate_ensure_partitions('outbox', 3);

-- 0011_outbox_replay: the highest offset each partition acknowledged to a relay; a partition
-- that later ends at or below it lost acknowledged records, which the relay sends again.
CREATE TABLE outbox_watermarks (
    topic           text NOT NULL,   -- the name in Kafka, deployment prefix included
    kafka_partition integer NOT NULL,
    acked_offset    bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, kafka_partition)
);

-- 0002_inbox: the inbox of every Kafka consumer: an event id is processed at most once per
-- consumer, recorded in the same transaction as its effect.
CREATE TABLE inbox (
    consumer     text NOT NULL,
    event_id     text NOT NULL,
    topic        text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- 0037: what a consumer whose effects are idempotent by the messages' own identity
-- (metering-ingest) has applied, one row per topic partition per poll, in the poll's transaction,
-- instead of an inbox row per message; pruned after its retention but for each partition's latest.
-- The inbox's rows are pruned after the consumers' retention too, found by a BRIN index.
CREATE TABLE consumer_offsets (
    consumer        text NOT NULL,
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    first_offset    bigint NOT NULL,
    last_offset     bigint NOT NULL,
    records         integer NOT NULL,
    applied_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (first_offset <= last_offset AND records > 0)
);
CREATE INDEX consumer_offsets_position ON consumer_offsets (consumer, topic, kafka_partition, last_offset);
CREATE INDEX consumer_offsets_applied ON consumer_offsets (applied_at);
CREATE INDEX inbox_processed ON inbox USING brin (processed_at);

-- 0007_admission_fast_path: one round trip to begin a decision, and no foreign key from
-- reservations to ledger_entries (every reservation insert took a KEY SHARE lock on its ledger
-- row, which on a hot budget makes every concurrent decision share one row lock).

-- 0009_group_commit: decisions begun a batch at a time (0015: and the override revision; 0031:
-- the highest of override and grant revisions).
-- Takes the ledger lock (shared) and the lock of every run of a batch (in one order, so two
-- batches never wait on each other in a cycle), then reads: first a row with only the highest
-- ledger sequence Postgres committed, then the latest decision of each run that has one.
-- VOLATILE on purpose: each query takes a fresh snapshot after the locks were granted. 0020: one
-- index probe per run, a plan that stays right when PL/pgSQL made it on an empty table. 0033: found
-- by its keys and read from its month's partition; a run whose latest decision is archived comes
-- back with its attempt and decided_at and no outcome, request or response (a resend is 410 Gone).
CREATE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    IF p_session THEN
        PERFORM pg_advisory_lock_shared(7301, 0);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(7301, 0);
    END IF;
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock(7302, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock(7302, lock_key);
        END IF;
    END LOOP;
END
$$;

-- 0036: what a batch reads once its locks are held, for budgetgate_begin_batch and
-- budgetgate_begin_decisions alike. 0039: always from its generic plans, made once per session
-- (a custom plan of the query over the partitioned decisions took 10 times as long to make as
-- to run); the decision is read by a LIMIT 1 subquery, which Postgres keeps apart, so every plan
-- probes the partition of each run's key (pruning the others as it runs), however empty the
-- tables were when it was made.
CREATE FUNCTION budgetgate_batch_reads(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
BEGIN
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
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at LIMIT 1) AS x ON true
        ORDER BY k.run_id;
END
$$;

CREATE FUNCTION budgetgate_begin_batch(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, false);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids);
END
$$;

-- Admission's: budgetgate_begin_batch with the locks taken at session level (migration 0036); the
-- caller lets them go once its one write committed (ledger_session).
CREATE FUNCTION budgetgate_begin_decisions(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, true);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids);
END
$$;

-- 0025: Redis's ledger sequence as recorded by writes other than decisions that tighten the
-- ledger (a settlement's increases, a late start's quota holds, a pool token's grant or renewal),
-- each in the transaction that commits it; the highest is kept, the others pruned.
CREATE TABLE ledger_marks (
    ledger_seq  bigint PRIMARY KEY,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- The roots the Redis ledger's shards place tenants by: a tenant named here keeps its keys on its
-- organisation's shard, any other on its own (0049; `budgetgate ledger roots`).
CREATE TABLE ledger_roots (
    tenant     text PRIMARY KEY CHECK (tenant <> ''),
    root       text NOT NULL CHECK (root <> ''),
    bundle_sha text NOT NULL,
    pinned_at  timestamptz NOT NULL DEFAULT now()
);

-- The highest ledger sequence Postgres committed: admission decides only on a Redis not behind it.
-- 0033: read from the keys, which outlive their decisions' archiving.
-- 0039: PL/pgSQL, so its plan is kept for the session (a SQL function with subqueries is
-- planned anew on every call).
CREATE FUNCTION budgetgate_committed_ledger_seq() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN GREATEST(COALESCE((SELECT max(k.ledger_seq) FROM decision_keys k WHERE k.ledger_seq IS NOT NULL), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m), 0))::bigint;
END
$$;

-- 0003_metering: usage normalized from metering samples (metering-ingest), deduplicated.
-- Amounts are milli-unit-seconds (GPU-seconds x 1000; one GPU-hour = 3,600,000).

-- One row per run with usage: its high-water mark (the largest counters of any accepted sample,
-- which never go down). A row exists only for a run that has a decision.
CREATE TABLE usage_runs (
    run_id                     text PRIMARY KEY,
    gpu_milli_hours_cumulative  bigint NOT NULL DEFAULT 0 CHECK (gpu_milli_hours_cumulative >= 0),
    node_milli_hours_cumulative bigint NOT NULL DEFAULT 0 CHECK (node_milli_hours_cumulative >= 0),
    samples                    integer NOT NULL DEFAULT 0,
    latest_observed_at         timestamptz,
    updated_at                 timestamptz NOT NULL DEFAULT now(),
    -- 0029: the run's capacity, as its decisions say (metering_capacity): the most GPUs and nodes
    -- any decision asked for (NULL: some decision names no count, no bound on that counter) and
    -- the earliest decided_at. A sample above max_gpus (max_nodes) x (observed_at -
    -- first_decided_at), plus the tolerance, is dead-lettered as impossible_usage.
    max_gpus                   integer,
    max_nodes                  integer,
    first_decided_at           timestamptz,
    -- 0034: the earliest observed_at of its samples (with latest_observed_at: where in time its
    -- records are, so finding one by its id reads those months' partitions alone); NULL: unknown,
    -- every month is read.
    earliest_observed_at       timestamptz,
    -- 0052: the last sample id the run has recorded, in length then code point order
    -- (usage_max_sample_id): a sample of a later id has no recorded sample of its id to find.
    -- '' for a run metering started (none yet); NULL: unknown, every sample is probed.
    max_sample_id              text COLLATE "C"
) WITH (fillfactor = 50);  -- 0053: room on each page for the update every poll makes (heap-only)

-- The later of `kept` and `added` in that order; NULL (unknown) stays NULL, and no id added keeps it.
CREATE FUNCTION usage_max_sample_id(kept text, added text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN kept IS NULL OR added IS NULL THEN kept
                WHEN (length(added), added COLLATE "C") > (length(kept), kept COLLATE "C") THEN added
                ELSE kept END
$$;

-- One row per accepted sample. gpu/node_milli_hours are the sample's own counters (what the run
-- had used as of observed_at); *_cumulative is the run's high-water mark after it, *_delta how
-- much it raised that (0 for a late sample, observed before the run's latest). Every row is
-- also a usage.records.v1 message with the same event_id.
-- Ordered by observed_at, the counters of a run never go down.
-- 0034: partitioned by the UTC month of observed_at, as decisions are (0033); its unique keys
-- hold observed_at (a sample id sent again at another instant is a conflict metering finds).
-- 0032: usage_records_observed: the records observed in a period, with what a chargeback report
-- reads of them (an index-only scan).
CREATE TABLE usage_records (
    run_id                      text NOT NULL,
    sample_id                   text NOT NULL,
    observed_at                 timestamptz NOT NULL,
    gpu_milli_hours             bigint NOT NULL CONSTRAINT usage_records_gpu_milli_hours_check CHECK (gpu_milli_hours >= 0),
    node_milli_hours            bigint NOT NULL CONSTRAINT usage_records_node_milli_hours_check CHECK (node_milli_hours >= 0),
    gpu_milli_hours_cumulative  bigint NOT NULL CONSTRAINT usage_records_check CHECK (gpu_milli_hours_cumulative >= gpu_milli_hours),
    node_milli_hours_cumulative bigint NOT NULL CONSTRAINT usage_records_check1 CHECK (node_milli_hours_cumulative >= node_milli_hours),
    gpu_milli_hours_delta       bigint NOT NULL CONSTRAINT usage_records_gpu_milli_hours_delta_check CHECK (gpu_milli_hours_delta >= 0),
    node_milli_hours_delta      bigint NOT NULL CONSTRAINT usage_records_node_milli_hours_delta_check CHECK (node_milli_hours_delta >= 0),
    late                        boolean NOT NULL,
    exporter                    text NOT NULL,
    source                      text NOT NULL CONSTRAINT usage_records_source_check CHECK (source IN ('kafka', 'http')),
    event_id                    text NOT NULL,
    recorded_at                 timestamptz NOT NULL DEFAULT now(),
    -- 0038: no primary key (run_id, sample_id, observed_at): the event id is derived from run and
    -- sample id, so (event_id, observed_at) is the same identity, with one index fewer per sample.
    CONSTRAINT usage_records_run_id_observed_at_key UNIQUE (run_id, observed_at),
    CONSTRAINT usage_records_event_id_key UNIQUE (event_id, observed_at)
) PARTITION BY RANGE (observed_at);
CREATE INDEX usage_records_observed ON usage_records (observed_at) INCLUDE (run_id, gpu_milli_hours_delta, node_milli_hours_delta);
CREATE TABLE usage_records_default PARTITION OF usage_records DEFAULT;
SELECT budgetgate_ensure_partitions('usage_records', 3);

-- Valid samples of runs without a decision yet, kept until one appears (then applied) or until
-- expires_at (observed_at + the grace period; then dead-lettered as unknown_run). 0027: a sender
-- limited to namespaces or tenants is kept with it (applied only to a run within them); '' and no
-- limits for a sender not limited (a token without limits, or Kafka).
CREATE TABLE metering_pending (
    run_id          text NOT NULL,
    sample_id       text NOT NULL,
    observed_at     timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL,
    source          text NOT NULL CHECK (source IN ('kafka', 'http')),
    topic           text NOT NULL,
    kafka_partition integer,
    kafka_offset    bigint,
    payload         bytea NOT NULL,
    -- JSON [[name, base64 value], ...]: bytea, because a header value may hold NUL bytes.
    headers         bytea NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    sender            text NOT NULL DEFAULT '',
    sender_namespaces text[] NOT NULL DEFAULT '{}',
    sender_tenants    text[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, sample_id, sender)
);
CREATE INDEX metering_pending_expiry ON metering_pending (expires_at);

-- 0029: the capacity of each run of $1 that has a decision, as its decisions say.
CREATE FUNCTION metering_capacity(p_run_ids text[])
RETURNS TABLE (run_id text, max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT d.run_id,
           CASE WHEN count(d.gpus) = count(*) THEN max(d.gpus) END,
           CASE WHEN count(d.nodes) = count(*) THEN max(d.nodes) END,
           min(d.decided_at)
    FROM decisions d WHERE d.run_id = ANY (p_run_ids) GROUP BY d.run_id
$$;

-- Begins judging a sample in one round trip: takes the run's lock, then returns the run's state
-- (role 'run': latest observed_at, the cumulative counters and, 0029, its capacity) and the recorded samples the new
-- one is compared with ('same_id', 'same_time', 'before', 'after'); for a run metering does not
-- know yet, only whether it has a decision (role 'decision'). VOLATILE on purpose: in READ
-- COMMITTED each query of a volatile function takes a fresh snapshot, so the reads see
-- everything committed before the lock was granted.
-- (0038: defined below, with and without the samples' event ids.)

-- 0010_metering_batches: begins judging a batch of samples ($1 run ids, $2 sample ids, $3 observed_at; one entry per
-- sample) in one round trip: takes the lock of every run (in lock-key order, so batches with
-- runs in common wait for each other instead of deadlocking), then returns
--   'run':      per run metering knows, its latest observed_at and cumulative counters;
--   'decision': per run metering does not know yet that has a decision;
--   per sample (idx, 1-based) of a known run, its recorded neighbours, as metering_begin_sample.
-- VOLATILE, so the reads after the locks see everything committed before they were granted.
-- (0038: defined below, with and without the samples' event ids.)

-- 0038: metering_begin_sample and metering_begin_batch with the samples' usage-record event ids,
-- by which a recorded sample of the same id is found (within the months its run has records in);
-- the versions without them, for processes of the release before, call these without event ids,
-- and a sample without one is found by run and sample id. (0019: each planned for every call.)
-- 0040: metering_begin_sample reads its run's row once (it read it twice).
CREATE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz, p_event_id text)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_run usage_runs%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(7310, hashtext(p_run_id));
    SELECT * INTO v_run FROM usage_runs r WHERE r.run_id = p_run_id;
    IF NOT FOUND THEN
        RETURN QUERY
            SELECT 'decision', NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz
            WHERE EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = p_run_id);
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 'run', NULL::text, v_run.latest_observed_at, v_run.gpu_milli_hours_cumulative, v_run.node_milli_hours_cumulative,
               v_run.max_gpus, v_run.max_nodes, v_run.first_decided_at;
    RETURN QUERY
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u
         WHERE p_event_id IS NOT NULL AND u.event_id = p_event_id
           AND u.observed_at >= COALESCE(v_run.earliest_observed_at, '-infinity')
           AND u.observed_at <= COALESCE(v_run.latest_observed_at, 'infinity') AND u.sample_id = p_sample_id
         LIMIT 1)
        UNION ALL
        (SELECT 'same_id', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE p_event_id IS NULL AND u.run_id = p_run_id AND u.sample_id = p_sample_id LIMIT 1)
        UNION ALL
        (SELECT 'same_time', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at = p_observed_at)
        UNION ALL
        (SELECT 'before', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at < p_observed_at
         ORDER BY u.observed_at DESC LIMIT 1)
        UNION ALL
        (SELECT 'after', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
         FROM usage_records u WHERE u.run_id = p_run_id AND u.observed_at > p_observed_at
         ORDER BY u.observed_at LIMIT 1);
END
$$;
ALTER FUNCTION metering_begin_sample(text, text, timestamptz, text) SET plan_cache_mode = force_custom_plan;

CREATE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_event_ids text[])
RETURNS TABLE (idx integer, role text, run_id text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    RETURN QUERY
        SELECT NULL::integer, 'run', r.run_id, NULL::text, r.latest_observed_at, r.gpu_milli_hours_cumulative, r.node_milli_hours_cumulative,
               r.max_gpus, r.max_nodes, r.first_decided_at
        FROM usage_runs r WHERE r.run_id = ANY (p_run_ids);
    RETURN QUERY
        SELECT NULL::integer, 'decision', x.id, NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::integer, NULL::integer, NULL::timestamptz
        FROM (SELECT DISTINCT i.id FROM unnest(p_run_ids) AS i(id)) AS x
        WHERE NOT EXISTS (SELECT 1 FROM usage_runs r WHERE r.run_id = x.id)
          AND EXISTS (SELECT 1 FROM decisions d WHERE d.run_id = x.id);
    RETURN QUERY
        WITH s AS (
            SELECT x.rid, x.sid, x.at, x.eid, x.i FROM unnest(p_run_ids, p_sample_ids, p_observed_at, p_event_ids) WITH ORDINALITY AS x(rid, sid, at, eid, i)
        ), latest AS (
            -- The latest recorded sample of each run: one index probe per run.
            SELECT l.run_id, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours
            FROM (SELECT DISTINCT y.rid FROM s AS y) AS k
            CROSS JOIN LATERAL (SELECT u.run_id, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
                                FROM usage_records u WHERE u.run_id = k.rid ORDER BY u.observed_at DESC LIMIT 1) AS l
        )
        -- The recorded sample of the same id, by its usage record's event id, within the months
        -- its run has records in (without one, from the release before: by run and sample id).
        SELECT s.i::integer, 'same_id', s.rid, u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN usage_runs r ON r.run_id = s.rid
        CROSS JOIN LATERAL (
            (SELECT u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u
             WHERE s.eid IS NOT NULL AND u.event_id = s.eid AND u.observed_at >= COALESCE(r.earliest_observed_at, '-infinity')
               AND u.observed_at <= COALESCE(r.latest_observed_at, 'infinity') AND u.sample_id = s.sid
             LIMIT 1)
            UNION ALL
            (SELECT u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE s.eid IS NULL AND u.run_id = s.rid AND u.sample_id = s.sid LIMIT 1)
        ) AS u
        UNION ALL
        -- The usual case, a sample after everything recorded: its neighbour before is the latest.
        SELECT s.i::integer, 'before', s.rid, l.sample_id, l.observed_at, l.gpu_milli_hours, l.node_milli_hours, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN latest l ON l.run_id = s.rid WHERE s.at > l.observed_at
        UNION ALL
        -- A late sample: its neighbours at, before and after its observed_at.
        SELECT s.i::integer, n.role, s.rid, n.sid, n.at, n.gpu, n.node, NULL::integer, NULL::integer, NULL::timestamptz
        FROM s JOIN latest l ON l.run_id = s.rid AND s.at <= l.observed_at
        CROSS JOIN LATERAL (
            (SELECT 'same_time' AS role, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at = s.at)
            UNION ALL
            (SELECT 'before', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at < s.at ORDER BY u.observed_at DESC LIMIT 1)
            UNION ALL
            (SELECT 'after', u.sample_id, u.observed_at, u.gpu_milli_hours, u.node_milli_hours
             FROM usage_records u WHERE u.run_id = s.rid AND u.observed_at > s.at ORDER BY u.observed_at LIMIT 1)
        ) AS n;
END
$$;
ALTER FUNCTION metering_begin_batch(text[], text[], timestamptz[], text[]) SET plan_cache_mode = force_custom_plan;

-- The versions of the release before, the same functions without event ids.
CREATE FUNCTION metering_begin_sample(p_run_id text, p_sample_id text, p_observed_at timestamptz)
RETURNS TABLE (role text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM metering_begin_sample(p_run_id, p_sample_id, p_observed_at, NULL::text)
$$;

CREATE FUNCTION metering_begin_batch(p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[])
RETURNS TABLE (idx integer, role text, run_id text, sample_id text, observed_at timestamptz, gpu_milli_hours bigint, node_milli_hours bigint,
               max_gpus integer, max_nodes integer, first_decided_at timestamptz)
LANGUAGE sql VOLATILE AS $$
    SELECT * FROM metering_begin_batch(p_run_ids, p_sample_ids, p_observed_at, NULL::text[])
$$;

-- 0017_metering_set_based: a Kafka poll's samples judged and recorded in SQL where the core's
-- set-based rules allow it.
-- Places a batch of valid samples ($1.. one array entry per sample, in batch order; event ids
-- are those of their usage records) in one round trip, under the locks of all their runs (taken
-- in lock-key order, as metering_begin_batch does). A run with a decision that metering does not
-- know yet and that has nothing pending is started here.
--
-- The samples of a "clean" run are judged here, set-based; every other sample comes back with
-- outcome 'python', for the core (budgetgate.core.metering.assess_batch) to judge: samples of a
-- run without a decision (kept pending), of a run with pending samples to apply first, and of a
-- run where any sample of the batch conflicts with another (same sample id, or same observed_at,
-- with other values, within the batch or against what is recorded) or would make the run's
-- counters go down. In a clean run every distinct point (observed_at, counters) that is not
-- recorded yet is accepted at its first occurrence in the batch and every other sample is a
-- duplicate, of the recorded sample or of that first occurrence, which is what assess gives
-- sample after sample (tests/integration/test_metering_set_based.py checks that it is).
-- The cumulative after an accepted sample is the running maximum of each counter, the delta
-- how much it rose, and a sample is late when observed before the latest recorded or accepted
-- earlier in the batch: as assess_batch. Accepted samples are recorded in usage_records and their
-- runs' high-water marks raised, in this statement.
--
-- 0029: a run with a sample above its usage bound (its capacity kept on its usage_runs row, with
-- the tolerance: $9 parts per million, $10 the clock slack in microseconds) is left to the core
-- too, which rejects the sample as impossible_usage or, its decisions asking for more by now,
-- raises the capacity; the runs started here get their capacity from metering_capacity.
--
-- 0046: p_fold (a quarter hour; NULL: none) makes metering a max-register: of a run's accepted
-- samples in one quarter hour of the batch, only the latest is recorded, as the quarter hour's
-- point, with the sum of their deltas and the cumulative after them; a late sample in the
-- quarter hour of a recorded point after it is a duplicate of that point (see the migration).
--
-- 0051: the recorded samples at and either side of a sample's time are probed only for a
-- sample observed at or before its run's latest.
--
-- Returns one row per sample (idx, 1-based): outcome 'accepted' (with cumulative, delta, late;
-- and for the sample recorded as its quarter hour's point, what its usage record carries and
-- its place among the run's records), 'duplicate' (with of_sample) or 'python'; with p_every
-- false (0051), none for an accepted sample that is neither its quarter hour's point nor late.
-- VOLATILE, so the statements after the locks see everything committed before they were granted.
CREATE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[], p_tolerance_ppm bigint, p_slack_us bigint, p_fold interval,
    p_every boolean
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean,
               record_order integer, record_gpu_cumulative bigint, record_node_cumulative bigint,
               record_gpu_delta bigint, record_node_delta bigint)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(7310, k.h)
    FROM (SELECT DISTINCT hashtext(r) AS h FROM unnest(p_run_ids) AS r ORDER BY 1) AS k;
    INSERT INTO usage_runs (run_id, max_gpus, max_nodes, first_decided_at, max_sample_id)
    SELECT c.run_id, c.max_gpus, c.max_nodes, c.first_decided_at, ''
    FROM metering_capacity(ARRAY(
        SELECT x.id FROM (SELECT DISTINCT i.id FROM unnest(p_run_ids) AS i(id)) AS x
        WHERE NOT EXISTS (SELECT 1 FROM usage_runs r WHERE r.run_id = x.id)
          AND NOT EXISTS (SELECT 1 FROM metering_pending p WHERE p.run_id = x.id))) AS c
    ON CONFLICT (run_id) DO NOTHING;
    RETURN QUERY
    WITH s AS (
        SELECT x.i::integer AS i, x.rid, x.sid, x.at, x.gpu, x.node, x.exporter, x.source, x.event_id
        FROM unnest(p_run_ids, p_sample_ids, p_observed_at, p_gpu, p_node, p_exporters, p_sources, p_event_ids)
             WITH ORDINALITY AS x(rid, sid, at, gpu, node, exporter, source, event_id, i)
    ), run AS (
        SELECT r.run_id AS rid, r.gpu_milli_hours_cumulative AS gpu, r.node_milli_hours_cumulative AS node, r.latest_observed_at AS latest,
               r.max_gpus, r.max_nodes, r.first_decided_at AS since, r.earliest_observed_at AS earliest, r.max_sample_id AS max_sid
        FROM usage_runs r WHERE r.run_id IN (SELECT DISTINCT y.rid FROM s AS y)
    ), probed AS (
        -- The samples of runs metering knows, each with the recorded sample of the same id.
        SELECT s.i, s.rid, s.sid, s.at, s.gpu, s.node, run.gpu AS run_gpu, run.node AS run_node, run.latest,
               COALESCE(same_id.rid = s.rid AND same_id.sid = s.sid, false) AS has_id, same_id.at AS id_at, same_id.gpu AS id_gpu, same_id.node AS id_node,
               -- Above what the run's GPUs (nodes) can have used since its earliest decision, with
               -- the tolerance (budgetgate.core.metering.UsageBound, the same exact arithmetic):
               -- left to the core, which rejects it (impossible_usage) or, the run's decisions
               -- asking for more by now, raises the capacity kept here.
               COALESCE(s.gpu::numeric * 1000000000 > run.max_gpus * span.us * (1000000 + p_tolerance_ppm)
                        OR s.node::numeric * 1000000000 > run.max_nodes * span.us * (1000000 + p_tolerance_ppm), false) AS over
        FROM s JOIN run USING (rid)
        -- No earliest decision (a run whose decisions are gone): no bound, as in the core.
        CROSS JOIN LATERAL (SELECT CASE WHEN run.since IS NOT NULL
                                        THEN GREATEST((extract(epoch FROM s.at) - extract(epoch FROM run.since)) * 1000000 + p_slack_us, 0) END AS us) AS span
        -- The same sample id, found by the event id of its usage record (derived from run and
        -- sample id): with run_id in the condition the planner may take the (run_id, observed_at)
        -- index and read the run's whole history. 0034: within the months the run has records
        -- in (its earliest and latest observed_at), so only their partitions are read. 0052: not
        -- for a sample id after every id the run has recorded (max_sample_id, in length then
        -- code point order): none can be of that id, and a condition on the outer row alone
        -- spares the whole probe.
        LEFT JOIN LATERAL (SELECT u.run_id AS rid, u.sample_id AS sid, u.observed_at AS at, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u
                           WHERE NOT (run.max_sid IS NOT NULL
                                      AND (length(s.sid), s.sid COLLATE "C") > (length(run.max_sid), run.max_sid COLLATE "C"))
                             AND u.event_id = s.event_id AND u.observed_at >= COALESCE(run.earliest, '-infinity')
                             AND u.observed_at <= COALESCE(run.latest, 'infinity')
                           LIMIT 1) AS same_id ON true
    ), known AS (
        -- Each with the recorded samples of the same time and, for one observed before the run's
        -- latest (late), either side of it; index probes only, whatever the run's history. 0051:
        -- probed only for a sample observed at or before its run's latest. A poll's samples of a
        -- run are mostly after it, with nothing recorded at or after their time, and each probe
        -- of the partitioned table cost its setup even where its condition was false.
        SELECT p.*, NULL::text AS time_sid, NULL::bigint AS time_gpu, NULL::bigint AS time_node, NULL::bigint AS before_gpu,
               NULL::bigint AS before_node, NULL::bigint AS after_gpu, NULL::bigint AS after_node, false AS covered, NULL::text AS after_sid
        FROM probed p WHERE p.latest IS NULL OR p.at > p.latest
        UNION ALL
        SELECT p.*, same_time.sid, same_time.gpu, same_time.node, before.gpu, before.node, after.gpu, after.node,
               -- 0046: a late sample in the quarter hour (p_fold) of a recorded point after it changes
               -- nothing a max-register keeps: a duplicate of that point (unless odd, below).
               (p_fold IS NOT NULL AND after.at IS NOT NULL
                AND date_bin(p_fold, after.at, timestamptz '2000-01-01 00:00:00+00') = date_bin(p_fold, p.at, timestamptz '2000-01-01 00:00:00+00')),
               after.sid
        FROM probed p
        LEFT JOIN LATERAL (SELECT u.sample_id AS sid, u.gpu_milli_hours AS gpu, u.node_milli_hours AS node
                           FROM usage_records u WHERE u.run_id = p.rid AND u.observed_at = p.at LIMIT 1) AS same_time ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node FROM usage_records u
                           WHERE u.run_id = p.rid AND u.observed_at < p.at AND p.at < p.latest
                           ORDER BY u.observed_at DESC LIMIT 1) AS before ON true
        LEFT JOIN LATERAL (SELECT u.gpu_milli_hours AS gpu, u.node_milli_hours AS node, u.observed_at AS at, u.sample_id AS sid FROM usage_records u
                           WHERE u.run_id = p.rid AND u.observed_at > p.at AND p.at < p.latest
                           ORDER BY u.observed_at LIMIT 1) AS after ON true
        WHERE p.at <= p.latest
    ), by_time AS (
        -- In time order per run: the sample before each (the first of an observed_at has
        -- another time before it), and the first sample of each observed_at.
        SELECT k.*, lag(k.at) OVER t AS prev_at, lag(k.gpu) OVER t AS prev_gpu, lag(k.node) OVER t AS prev_node,
               first_value(k.sid) OVER (PARTITION BY k.rid, k.at ORDER BY k.i) AS first_sid
        FROM known k WINDOW t AS (PARTITION BY k.rid ORDER BY k.at, k.i)
    ), odd AS (
        -- Runs with a sample the set-based judgement does not cover: one above the run's bound, a
        -- conflict (same id or same time with other values, in the batch or recorded), or counters
        -- that go down.
        SELECT b.rid FROM by_time b
        WHERE b.over
           OR (b.has_id AND (b.id_at, b.id_gpu, b.id_node) IS DISTINCT FROM (b.at, b.gpu, b.node))
           OR (b.time_sid IS NOT NULL AND (b.time_gpu, b.time_node) IS DISTINCT FROM (b.gpu, b.node))
           OR b.gpu < b.prev_gpu OR b.node < b.prev_node
           OR (b.prev_at = b.at AND (b.prev_gpu <> b.gpu OR b.prev_node <> b.node))
           OR ((b.latest IS NULL OR b.at > b.latest) AND (b.gpu < b.run_gpu OR b.node < b.run_node))
           OR b.gpu < b.before_gpu OR b.node < b.before_node OR b.after_gpu < b.gpu OR b.after_node < b.node
        UNION
        SELECT k.rid FROM known k GROUP BY k.rid, k.sid
        HAVING min(k.at) <> max(k.at) OR min(k.gpu) <> max(k.gpu) OR min(k.node) <> max(k.node)
    ), clean AS (
        SELECT b.*, b.time_sid IS NULL AND b.prev_at IS DISTINCT FROM b.at AND NOT b.covered AS accepted
        FROM by_time b WHERE b.rid NOT IN (SELECT o.rid FROM odd o)
    ), accepted AS (
        -- In batch order per run: the run's high-water mark before and after each accepted sample.
        SELECT c.i, c.rid, c.sid, c.at, c.gpu, c.node,
               GREATEST(c.run_gpu, max(c.gpu) OVER upto) AS cum_gpu, GREATEST(c.run_node, max(c.node) OVER upto) AS cum_node,
               GREATEST(c.run_gpu, max(c.gpu) OVER earlier) AS was_gpu, GREATEST(c.run_node, max(c.node) OVER earlier) AS was_node,
               COALESCE(c.at < GREATEST(c.latest, max(c.at) OVER earlier), false) AS is_late
        FROM clean c WHERE c.accepted
        WINDOW upto AS (PARTITION BY c.rid ORDER BY c.i),
               earlier AS (PARTITION BY c.rid ORDER BY c.i ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
    ), folded AS (
        -- 0046: a run's accepted samples of one quarter hour (p_fold) in this batch are one point,
        -- the latest of them: one usage row and one usage record, whose delta is the sum of the
        -- quarter hour's deltas and whose cumulative is the run's high-water mark after them.
        -- Usage up to any quarter hour (every window boundary, hour bucket and rate change is
        -- one) is the latest point before it, which is kept (a point on the quarter hour starts
        -- the next: the reconciler charges an increment to the window, bucket and rate of its
        -- end). p_fold NULL: every sample is its own point (accepted samples of a run never
        -- share an observed_at).
        SELECT a.*, row_number() OVER (PARTITION BY a.rid, a.slot ORDER BY a.at DESC) = 1 AS kept,
               max(a.i) OVER g AS rec_i, max(a.cum_gpu) OVER g AS rec_gpu, max(a.cum_node) OVER g AS rec_node,
               (sum(a.cum_gpu - a.was_gpu) OVER g)::bigint AS rec_gpu_delta, (sum(a.cum_node - a.was_node) OVER g)::bigint AS rec_node_delta
        FROM (SELECT a.*, CASE WHEN p_fold IS NULL THEN a.at ELSE date_bin(p_fold, a.at, timestamptz '2000-01-01 00:00:00+00') END AS slot
              FROM accepted a) AS a
        WINDOW g AS (PARTITION BY a.rid, a.slot)
    ), recorded AS (
        INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                                   node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id)
        SELECT f.rid, f.sid, f.at, f.gpu, f.node, f.rec_gpu, f.rec_node, f.rec_gpu_delta, f.rec_node_delta, f.is_late,
               s.exporter, s.source, s.event_id
        FROM folded f JOIN s USING (i) WHERE f.kept
    ), raised AS (
        UPDATE usage_runs r
        SET gpu_milli_hours_cumulative = x.gpu, node_milli_hours_cumulative = x.node, samples = r.samples + x.added,
            latest_observed_at = GREATEST(r.latest_observed_at, x.latest), earliest_observed_at = LEAST(r.earliest_observed_at, x.earliest),
            max_sample_id = usage_max_sample_id(r.max_sample_id, x.top), updated_at = now()
        -- 0052: from folded, whose rows are accepted's, with the last id recorded (kept).
        FROM (SELECT a.rid, max(a.cum_gpu) AS gpu, max(a.cum_node) AS node, count(*)::integer AS added, max(a.at) AS latest, min(a.at) AS earliest,
                     (array_agg(a.sid ORDER BY length(a.sid) DESC, a.sid COLLATE "C" DESC) FILTER (WHERE a.kept))[1] AS top
              FROM folded a GROUP BY a.rid) AS x
        WHERE r.run_id = x.rid
    )
    -- An accepted sample kept as its quarter hour's point also says what its usage record
    -- carries, and where it goes among the run's records (record_order: the batch index of the
    -- quarter hour's last sample, so a run's records raise its cumulative in order).
    SELECT f.i, 'accepted', NULL::text, f.cum_gpu, f.cum_node, f.cum_gpu - f.was_gpu, f.cum_node - f.was_node, f.is_late,
           CASE WHEN f.kept THEN f.rec_i END, CASE WHEN f.kept THEN f.rec_gpu END, CASE WHEN f.kept THEN f.rec_node END,
           CASE WHEN f.kept THEN f.rec_gpu_delta END, CASE WHEN f.kept THEN f.rec_node_delta END
    FROM folded f
    -- 0051: without p_every, an accepted sample that is neither its quarter hour's point nor late
    -- has no row (a poll read from Kafka counts it; its own figures are read by no one).
    WHERE p_every OR f.kept OR f.is_late
    UNION ALL
    -- A duplicate of the recorded sample of its id, or of the first sample of its observed_at,
    -- recorded or accepted earlier in the batch.
    SELECT c.i, 'duplicate', CASE WHEN c.has_id THEN c.sid ELSE COALESCE(c.time_sid, CASE WHEN c.covered THEN c.after_sid END, c.first_sid) END,
           NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean, NULL::integer, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint
    FROM clean c WHERE NOT c.accepted
    UNION ALL
    SELECT s.i, 'python', NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::boolean,
           NULL::integer, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint
    FROM s WHERE s.i NOT IN (SELECT c.i FROM clean c);
END
$$;
ALTER FUNCTION metering_place_batch(text[], text[], timestamptz[], bigint[], bigint[], text[], text[], text[], bigint, bigint, interval, boolean)
    SET plan_cache_mode = force_custom_plan;  -- 0019, 0029
-- 0051: the signature without p_every answers every sample, for processes of the release before.
CREATE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[], p_tolerance_ppm bigint, p_slack_us bigint, p_fold interval
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean,
               record_order integer, record_gpu_cumulative bigint, record_node_cumulative bigint,
               record_gpu_delta bigint, record_node_delta bigint)
LANGUAGE sql VOLATILE AS $$
    SELECT p.* FROM metering_place_batch(p_run_ids, p_sample_ids, p_observed_at, p_gpu, p_node, p_exporters, p_sources, p_event_ids,
                                         p_tolerance_ppm, p_slack_us, p_fold, true) AS p
$$;
-- 0046: the signature without p_fold, for processes of the release before until they are all
-- replaced: every sample its own point, as it was.
CREATE FUNCTION metering_place_batch(
    p_run_ids text[], p_sample_ids text[], p_observed_at timestamptz[], p_gpu bigint[], p_node bigint[],
    p_exporters text[], p_sources text[], p_event_ids text[], p_tolerance_ppm bigint, p_slack_us bigint
)
RETURNS TABLE (idx integer, outcome text, of_sample text, gpu_cumulative bigint, node_cumulative bigint,
               gpu_delta bigint, node_delta bigint, late boolean)
LANGUAGE sql VOLATILE AS $$
    SELECT p.idx, p.outcome, p.of_sample, p.gpu_cumulative, p.node_cumulative, p.gpu_delta, p.node_delta, p.late
    FROM metering_place_batch(p_run_ids, p_sample_ids, p_observed_at, p_gpu, p_node, p_exporters, p_sources, p_event_ids,
                              p_tolerance_ppm, p_slack_us, NULL::interval) AS p
$$;

-- 0004_reconciler: the facts the reconciler settles runs from (lifecycle events, usage samples),
-- what each run is charged on each ledger key, and the hold and alert state of budgets.
-- No foreign keys to ledger_entries: a KEY SHARE lock on a hot ledger row per insert would
-- queue behind every concurrent change to that row.

-- Lifecycle events as the platform reported them; the event id deduplicates resends.
CREATE TABLE lifecycle_events (
    event_id   text PRIMARY KEY,
    run_id     text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('STARTED', 'COMPLETED', 'FAILED', 'CANCELLED', 'EVICTED', 'READMITTED', 'STORED')),
    event_time timestamptz NOT NULL,
    gpus       integer NOT NULL DEFAULT 0 CHECK (gpus >= 0),
    nodes      integer NOT NULL DEFAULT 0 CHECK (nodes >= 0),
    flavor     text,
    reason     text,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lifecycle_events_run ON lifecycle_events (run_id);

-- Usage samples from usage.records.v1: the run's cumulative counters as of observed_at
-- (milli-unit-seconds); the exporter's sample id deduplicates resends.
CREATE TABLE run_samples (
    run_id      text NOT NULL,
    sample_id   text NOT NULL,
    observed_at timestamptz NOT NULL,
    gpu         bigint NOT NULL CHECK (gpu >= 0),
    node        bigint NOT NULL CHECK (node >= 0),
    received_at timestamptz NOT NULL DEFAULT now(),
    gpu_high    bigint,  -- high-water marks through this sample in (observed_at, sample_id) order; NULL until folded
    node_high   bigint,
    PRIMARY KEY (run_id, sample_id)
);
CREATE INDEX run_samples_line ON run_samples (run_id, observed_at, sample_id COLLATE "C") WHERE gpu_high IS NOT NULL;
CREATE INDEX run_samples_unfolded ON run_samples (run_id) WHERE gpu_high IS NULL;

-- A run's metered side as folded so far; no row: fold the whole run on its next settlement.
CREATE TABLE run_meters (
    run_id    text PRIMARY KEY,
    gpu       bigint NOT NULL,
    node      bigint NOT NULL,
    covered   timestamptz,
    last_at   timestamptz,
    last_id   text,
    used      jsonb NOT NULL DEFAULT '{}',
    timed     jsonb NOT NULL DEFAULT '[]'
);

-- Settlements that failed for a reason other than an outage, retried a bounded number of times.
CREATE TABLE settlement_failures (
    run_id          text PRIMARY KEY,
    attempts        integer NOT NULL DEFAULT 1,
    reason          text NOT NULL,
    dead            boolean NOT NULL DEFAULT false,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now()
);

-- Runs with new facts, waiting to be settled; claimed with FOR UPDATE SKIP LOCKED.
CREATE TABLE runs_to_settle (
    run_id text PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT now()
);

-- Where each run stands, as last settled. review_at: when time alone changes its charges next.
CREATE TABLE run_settlements (
    run_id        text PRIMARY KEY,
    decision_id   uuid NOT NULL REFERENCES decision_keys (decision_id),
    phase         text NOT NULL CHECK (phase IN ('admitted', 'running', 'evicted', 'ended')),
    final         boolean NOT NULL DEFAULT false,
    provisional   boolean NOT NULL DEFAULT false,
    released      boolean NOT NULL DEFAULT false,  -- the reservation was given back unused
    over_running  boolean NOT NULL DEFAULT false,
    final_state   text,
    ended_at      timestamptz,
    wall          bigint NOT NULL DEFAULT 0,       -- wall milli-hours across all admissions
    projected_gpu bigint NOT NULL,
    actual_gpu    bigint NOT NULL DEFAULT 0,
    error_gpu     bigint NOT NULL DEFAULT 0,       -- actual - projected
    review_at     timestamptz,
    revision      integer NOT NULL DEFAULT 0,
    settled_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX run_settlements_review ON run_settlements (review_at) WHERE review_at IS NOT NULL;

-- What a run has consumed on a ledger key: per hour bucket on rolling windows (so usage can age
-- out), in one bucket (1970-01-01) on calendar windows.
CREATE TABLE run_charges (
    run_id     text NOT NULL,
    ledger_key text NOT NULL,
    bucket     timestamptz NOT NULL,
    amount     bigint NOT NULL CHECK (amount > 0),
    PRIMARY KEY (run_id, ledger_key, bucket)
);
CREATE INDEX run_charges_key ON run_charges (ledger_key, bucket);

-- How far usage has aged out of each rolling-window ledger key: buckets before aged_through
-- no longer count in its consumed.
CREATE TABLE rolling_ages (
    ledger_key   text PRIMARY KEY,
    rolling_days integer NOT NULL CHECK (rolling_days >= 1),
    aged_through timestamptz NOT NULL
);

-- Budgets on hold (on_exhausted hold / hold-and-drain, consumed >= limit); the row goes when
-- the hold is lifted.
CREATE TABLE budget_holds (
    ledger_key   text PRIMARY KEY,
    policy_id    text NOT NULL,
    scope_id     text NOT NULL,
    on_exhausted text NOT NULL CHECK (on_exhausted IN ('hold', 'hold-and-drain')),
    held_at      timestamptz NOT NULL DEFAULT now()
);

-- Threshold alerts sent, once per ledger key (window), measure and threshold (0030).
CREATE TABLE budget_alerts (
    ledger_key        text NOT NULL,
    threshold_percent integer NOT NULL CHECK (threshold_percent > 0),
    alerted_at        timestamptz NOT NULL DEFAULT now(),
    measure           text NOT NULL DEFAULT 'consumed' CHECK (measure IN ('committed', 'consumed')),
    PRIMARY KEY (ledger_key, measure, threshold_percent)
);

-- 0005_evidence: the evidence-emitter's delivery state, the reconciliations it consumed, and
-- the audit views (one per question the design asks).

-- Every OpenLineage event, stored in the transaction that consumed its source message and then
-- delivered by the sender: `delivered` is what keeps a restart from sending it again. A
-- reconciliation consumed before its decision `waits` for it (or for a timeout), so its facet
-- carries the decision's evaluations.
CREATE TABLE evidence_events (
    seq             bigserial PRIMARY KEY,
    source_event_id text NOT NULL UNIQUE,   -- event id of the decision / reconciliation message
    stage           text NOT NULL CHECK (stage IN ('decision', 'reconciliation')),
    run_id          text NOT NULL,          -- the platform's stable run id
    run_uuid        uuid NOT NULL,          -- the OpenLineage runId derived from it
    decision_id     text,
    event_type      text NOT NULL CHECK (event_type IN ('START', 'RUNNING', 'COMPLETE', 'ABORT', 'FAIL', 'OTHER')),
    event_time      timestamptz NOT NULL,
    payload         jsonb NOT NULL,         -- the RunEvent as sent
    state           text NOT NULL DEFAULT 'pending' CHECK (state IN ('waiting', 'pending', 'delivered', 'dead')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz
);
CREATE INDEX evidence_events_pending ON evidence_events (next_attempt_at, seq) WHERE state = 'pending';
CREATE INDEX evidence_events_pending_run ON evidence_events (run_uuid, event_time, seq) WHERE state = 'pending';
CREATE INDEX evidence_events_waiting ON evidence_events (run_id) WHERE state = 'waiting';
CREATE INDEX evidence_events_run ON evidence_events (run_id, seq);

-- Events the receiver refused (4xx): kept with its answer, never retried.
CREATE TABLE evidence_dead_letters (
    seq         bigint PRIMARY KEY REFERENCES evidence_events (seq),
    status_code integer,
    body        text NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now()
);

-- The budget.reconciliations.v1 messages consumed, as the audit views need them.
CREATE TABLE evidence_reconciliations (
    event_id       text PRIMARY KEY,
    run_id         text NOT NULL,
    decision_id    text,
    final_state    text NOT NULL,
    terminal       boolean NOT NULL,        -- the run has ended (COMPLETED, FAILED, CANCELLED, ...)
    provisional    boolean NOT NULL,
    policy_git_sha text NOT NULL,
    projected_gpu  bigint NOT NULL,         -- milli-GPU-seconds, as everywhere in the ledger
    actual_gpu     bigint NOT NULL,
    reconciled_at  timestamptz NOT NULL,
    seq            bigserial NOT NULL
);
CREATE INDEX evidence_reconciliations_run ON evidence_reconciliations (run_id, reconciled_at);

CREATE TABLE evidence_reconciliation_charges (
    event_id     text NOT NULL REFERENCES evidence_reconciliations (event_id),
    ledger_key   text NOT NULL,
    scope_id     text NOT NULL,
    window_key   text NOT NULL,
    window_start timestamptz,
    window_end   timestamptz,
    policy_id    text,
    unit         text NOT NULL,
    amount       bigint NOT NULL,
    PRIMARY KEY (event_id, ledger_key)
);

-- Denial rate by scope and window: runs counted once, by their latest decision (a platform's
-- retries reuse the run id, and Marquez keeps one run per run id). Label violations are judged
-- before any ledger and have no window.
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

-- Reservation-to-actual error by scope, window and policy SHA, over each run's latest
-- reconciliation once the run has ended. GPU amounts in milli-GPU-seconds.
CREATE VIEW audit_reservation_error AS
WITH latest AS (
    SELECT DISTINCT ON (run_id) *
    FROM evidence_reconciliations ORDER BY run_id, reconciled_at DESC, seq DESC
), scoped AS (
    SELECT DISTINCT r.run_id, c.scope_id, c.window_key, c.window_start, c.window_end, r.policy_git_sha,
           r.projected_gpu, r.actual_gpu, r.provisional
    FROM latest r JOIN evidence_reconciliation_charges c ON c.event_id = r.event_id
    WHERE r.terminal
)
SELECT scope_id,
       window_key,
       window_start,
       window_end,
       policy_git_sha,
       count(*)                                   AS runs,
       count(*) FILTER (WHERE provisional)        AS provisional_runs,
       sum(projected_gpu)::bigint                 AS reserved_gpu,
       sum(actual_gpu)::bigint                    AS actual_gpu,
       sum(actual_gpu - projected_gpu)::bigint    AS error_gpu,
       sum(abs(actual_gpu - projected_gpu))::bigint AS abs_error_gpu,
       round(sum(actual_gpu - projected_gpu)::numeric / nullif(sum(projected_gpu), 0), 4) AS error_ratio
FROM scoped
GROUP BY scope_id, window_key, window_start, window_end, policy_git_sha;

-- Window exhaustion: when each calendar-window budget ran out, or when it will at its burn rate
-- so far. It ran out at the first decision that found or left it with no room at all (0012: a
-- run turned away for being larger than the room left did not exhaust it; the budget still had
-- room, and a DELAY names when it will have enough). Used = consumed + held reservations.
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

-- Decisions by policy SHA: what each policy revision answered, so a change in enforcement is
-- attributable to the revision that made it.
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

-- The evidence not yet delivered, for dashboards (the emitter exports the same as metrics).
CREATE VIEW audit_evidence_backlog AS
SELECT count(*) FILTER (WHERE state IN ('pending', 'waiting'))                        AS pending,
       count(*) FILTER (WHERE state = 'dead')                                           AS dead,
       count(*) FILTER (WHERE state = 'delivered')                                      AS delivered,
       extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('pending', 'waiting'))) AS oldest_pending_seconds
FROM evidence_events;

-- 0006_quotas_pools: what runs hold at once (for hard quotas and fair share) and tokens held
-- in pools toward external services. Redis keeps live counters; these rows are the truth it is
-- rebuilt from.

CREATE TABLE run_holds (
    run_id      text PRIMARY KEY,
    decision_id uuid NOT NULL REFERENCES decision_keys (decision_id),
    tenant      text,
    gpus        integer NOT NULL CHECK (gpus >= 0),
    nodes       integer NOT NULL CHECK (nodes >= 0),
    sensitive   boolean NOT NULL DEFAULT false,
    state       text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz
);
CREATE INDEX run_holds_held ON run_holds (tenant) WHERE state = 'held';

CREATE TABLE pool_allocations (
    namespace        text NOT NULL,
    token            text NOT NULL,
    levels           text[] NOT NULL,   -- the declared pools it counts against, most specific first
    project          text NOT NULL DEFAULT '',
    sub_namespace    text NOT NULL DEFAULT '',
    run_id           text,              -- set when granted together with a submission
    lease_expires_at timestamptz NOT NULL,
    state            text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released')),
    granted_at       timestamptz NOT NULL DEFAULT now(),
    released_at      timestamptz,
    PRIMARY KEY (namespace, token)
);
CREATE INDEX pool_allocations_held ON pool_allocations (namespace) WHERE state = 'held';
CREATE INDEX pool_allocations_run ON pool_allocations (run_id) WHERE run_id IS NOT NULL;

-- authenticated callers (0013_auth)

CREATE TABLE api_tokens (
    token_id    uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    secret_hash bytea NOT NULL UNIQUE,
    roles       text[] NOT NULL CHECK (cardinality(roles) > 0),
    namespaces  text[] NOT NULL DEFAULT '{}',   -- globs; empty = every namespace
    tenants     text[] NOT NULL DEFAULT '{}',   -- empty = every tenant
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    revoked_at  timestamptz
);

CREATE TABLE admin_log (
    id        bigserial PRIMARY KEY,
    actor     text NOT NULL,
    action    text NOT NULL,
    subject   text NOT NULL,
    details   jsonb NOT NULL DEFAULT '{}',
    logged_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE pool_allocations ADD COLUMN principal text;

-- tenant overrides (0015_tenant_overrides)

CREATE TABLE tenant_overrides (
    revision   bigserial PRIMARY KEY,
    tenant     text NOT NULL,
    -- field -> {"value", "git" (the Git value it was set against), and for budgets "policy_id",
    -- "unit" and "amount" (the limit in ledger units)}; see budgetgate/core/overrides.py
    settings   jsonb NOT NULL,
    actor      text NOT NULL,
    cause      text NOT NULL CHECK (cause IN ('api', 'policy.apply')),
    reason     text,
    git_sha    text,           -- the active bundle when the change was made
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tenant_overrides_tenant ON tenant_overrides (tenant, revision DESC);

-- Every tenant's override set at its latest revision (tenants whose overrides were all cleared
-- have `{}`).
CREATE VIEW tenant_overrides_current AS
SELECT DISTINCT ON (tenant) revision, tenant, settings, actor, cause, reason, git_sha, changed_at
FROM tenant_overrides ORDER BY tenant, revision DESC;

-- 0016_fair_share_waiting: each tenant's GPU usage decayed with the fair-share half-life, kept by
-- the reconciler one usage change at a time (core/decay.py), read by admission for the decayed
-- share of its answers; and the runs waiting for budget or quota headroom.

CREATE TABLE fair_share_usage (
    tenant            text PRIMARY KEY,
    decayed_gpu       double precision NOT NULL,   -- milli-GPU-hours, each weighted 2^(-age / half-life), as of reckoned_at
    reckoned_at       timestamptz NOT NULL,
    half_life_seconds double precision NOT NULL CHECK (half_life_seconds > 0),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Runs refused for now (a DELAY waits for budget, a concurrency rejection for quota headroom),
-- registered by the reconciler from budget.decisions.v1 and forgotten when the run is decided
-- again or ends; when room returns for one, a HEADROOM action goes out (once per cause).
CREATE TABLE waiting_runs (
    run_id        text PRIMARY KEY,
    attempt       integer NOT NULL,
    decision_id   uuid NOT NULL UNIQUE,
    waiting_for   text NOT NULL CHECK (waiting_for IN ('budget', 'quota')),
    tenant        text,
    labels        jsonb NOT NULL,
    sensitive     boolean NOT NULL,       -- counted against the sensitive pool when registered
    gpus          integer NOT NULL,
    nodes         integer NOT NULL,
    needs         jsonb NOT NULL,         -- [[policy id, unit, amount], ...] of the budgets that refused it
    policy_ids    text[] NOT NULL,        -- the same policies, for finding the runs a release concerns
    checked_sha   text,                   -- the policy bundle it was last judged under
    decided_at    timestamptz NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX waiting_runs_tenant ON waiting_runs (tenant) WHERE waiting_for = 'quota';
CREATE INDEX waiting_runs_policies ON waiting_runs USING gin (policy_ids);

-- The HEADROOM actions sent: one per waiting decision and cause (the event that freed room).
CREATE TABLE headroom_notices (
    decision_id uuid NOT NULL,
    cause       text NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (decision_id, cause)
);

-- 0022_admitted_objects: the Kubernetes objects the admission webhook let through on a decision
-- (their own ALLOW, or as the child of such an object); a child naming an admitted kind as its
-- controller is let through without a decision only when that owner is here (or is a run
-- admitted under its own UID).
CREATE TABLE admitted_objects (
    uid         text PRIMARY KEY,
    namespace   text NOT NULL,
    kind        text NOT NULL,
    name        text NOT NULL,
    run_id      text NOT NULL,
    admitted_at timestamptz NOT NULL DEFAULT now()
);
-- 0023: walked in admission order by the reconciler's pruning (rows of runs ended longer ago than
-- the retention), from where its last pass stopped.
CREATE INDEX admitted_objects_admitted_at_uid ON admitted_objects (admitted_at, uid);

-- 0024: the length of the lease a submission's token was granted with (renewed by it while its
-- run shows it is alive); NULL for tokens granted before, renewed by their pool's default.
ALTER TABLE pool_allocations ADD COLUMN lease_seconds integer CHECK (lease_seconds > 0);

-- 0028_provisional_holds: the provisional holds of runs the Kubernetes validating webhook admitted
-- (the API server may still refuse the object after it), still open: admission writes one with
-- the decision; the reconciler deletes it when a fact confirms the object, or gives the hold back
-- after BUDGETGATE_PROVISIONAL_HOLD_SECONDS, or the run ends. (0028 also let lifecycle_events hold
-- STORED, above.)
CREATE TABLE provisional_holds (
    run_id      text PRIMARY KEY,
    decision_id uuid NOT NULL,
    held_since  timestamptz NOT NULL
);
CREATE INDEX provisional_holds_held_since ON provisional_holds (held_since);

-- 0031_budget_grants: hours (or money) granted to, or taken from, one budget in one window over
-- the API, on top of the Git limit; the revision comes from the tenant override sequence, so one
-- number pins the overrides and grants a decision was made under (core/grants.py).
CREATE TABLE budget_grants (
    revision     bigint PRIMARY KEY DEFAULT nextval('tenant_overrides_revision_seq'),
    policy_id    text NOT NULL,
    scope_id     text NOT NULL,
    unit         text NOT NULL CHECK (unit IN ('gpu_hours', 'node_hours', 'wall_hours', 'cost')),
    ledger_key   text NOT NULL,
    window_start timestamptz NOT NULL,
    window_end   timestamptz NOT NULL,
    amount       bigint NOT NULL CHECK (amount <> 0),   -- in the ledger's units; negative takes away
    limit_before bigint NOT NULL,                        -- the window's limit before and after it
    limit_after  bigint NOT NULL CHECK (limit_after >= 0),
    actor        text NOT NULL,
    reason       text NOT NULL CHECK (reason <> ''),
    git_sha      text NOT NULL,                          -- the active bundle when it was made
    granted_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX budget_grants_window ON budget_grants (policy_id, ledger_key, revision);

-- 0033: the runs the ledger still works on, each with why (a run may show up once per reason): their
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

-- 0041: escrow leases, the slices of a budget whose runs fall under several roots of the account
-- tree (shards of the Redis ledger), each root's slice reserved on by its own decisions alone
-- (budgetgate.ledger.escrow_leases; docs/scale-out.md). The budget's own ledger entry holds the limit;
-- each lease is a ledger entry of its own (its reservations and what it consumed, as any ledger
-- key), on its root's shard, with a size: what it may hold. Postgres is the truth of the sizes:
-- a grant is written here before Redis's lease grows, a return after Redis's lease shrank (and
-- the return's ledger sequence is recorded in ledger_marks), so Redis never lets a root reserve
-- more than Postgres granted it, and a Redis that lost a return is caught as behind.
CREATE TABLE escrow_leases (
    ledger_key text NOT NULL REFERENCES ledger_entries (ledger_key),  -- the budget's (global) entry
    root       text NOT NULL,
    lease_key  text NOT NULL UNIQUE REFERENCES ledger_entries (ledger_key),  -- the slice's entry
    size       bigint NOT NULL CHECK (size >= 0),
    PRIMARY KEY (ledger_key, root)
);

-- Every move of a lease's size, in the order made: what was granted or returned, and why.
CREATE TABLE escrow_moves (
    id         bigserial PRIMARY KEY,
    ledger_key text NOT NULL,
    root       text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('grant', 'return')),
    amount     bigint NOT NULL CHECK (amount > 0),
    size_after bigint NOT NULL CHECK (size_after >= 0),
    ledger_seq bigint,   -- a return's: the ledger sequence its shrinking advanced Redis to
    reason     text NOT NULL CHECK (reason <> ''),
    moved_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX escrow_moves_lease ON escrow_moves (ledger_key, root, id);

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
-- 0043: a ledger generation per shard of the Redis ledger (budgetgate.core.shards). With several
-- shards, shard i's sequence hands out only numbers ≡ i (mod 64), so the highest number shard i
-- committed is the highest of its residue, in decision_keys and ledger_marks alike: read by an
-- index on the residue, one short backward scan per table. With one shard (the default) the
-- whole ledger is shard 0 of 1 and its committed sequence is the highest number, as before.
CREATE INDEX decision_keys_shard_seq ON decision_keys ((ledger_seq % 64), ledger_seq) WHERE ledger_seq IS NOT NULL;
CREATE INDEX ledger_marks_shard_seq ON ledger_marks ((ledger_seq % 64), ledger_seq);

CREATE FUNCTION budgetgate_committed_ledger_seq(p_shard integer, p_shards integer) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_shards = 1 THEN
        RETURN budgetgate_committed_ledger_seq();
    END IF;
    RETURN GREATEST(COALESCE((SELECT max(k.ledger_seq) FROM decision_keys k
                              WHERE k.ledger_seq IS NOT NULL AND k.ledger_seq % 64 = p_shard), 0),
                    COALESCE((SELECT max(m.ledger_seq) FROM ledger_marks m WHERE m.ledger_seq % 64 = p_shard), 0))::bigint;
END
$$;
-- 0044: a ledger lock per shard of the Redis ledger (budgetgate.core.shards): advisory lock
-- (7301, shard), taken shared by whatever changes a shard's reservations and exclusively by that
-- shard's rebuild and drift repair, so a shard is rebuilt while the others decide on. One shard
-- (the default) is shard 0: the lock every release before took. A batch of admission decisions
-- may span shards (one reserve script per shard, each decision on one): it takes the lock of
-- every shard it touches, in shard order, and reads each one's committed ledger sequence (0043),
-- a first row per shard. The functions of one argument stay for processes of the release before.
CREATE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean, p_shards integer[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock_key integer;
BEGIN
    FOR lock_key IN SELECT DISTINCT s FROM unnest(p_shards) AS s ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock_shared(7301, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock_shared(7301, lock_key);
        END IF;
    END LOOP;
    FOR lock_key IN SELECT DISTINCT hashtext(r) FROM unnest(p_run_ids) AS r ORDER BY 1 LOOP
        IF p_session THEN
            PERFORM pg_advisory_lock(7302, lock_key);
        ELSE
            PERFORM pg_advisory_xact_lock(7302, lock_key);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_lock_batch(p_run_ids text[], p_session boolean) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, p_session, ARRAY[0]);
END
$$;

CREATE FUNCTION budgetgate_batch_reads(p_run_ids text[], p_shards integer[], p_count integer)
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz, shard integer)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    revision bigint := GREATEST(COALESCE((SELECT max(o.revision) FROM tenant_overrides o), 0),
                                COALESCE((SELECT max(g.revision) FROM budget_grants g), 0));
BEGIN
    RETURN QUERY
        SELECT NULL::text, NULL::uuid, NULL::integer, NULL::text, NULL::jsonb, NULL::jsonb,
               CASE WHEN p_count = 1 THEN budgetgate_committed_ledger_seq() ELSE budgetgate_committed_ledger_seq(s, p_count) END,
               revision, NULL::timestamptz, s
        FROM (SELECT DISTINCT s FROM unnest(p_shards) AS s) AS shards(s) ORDER BY s;
    RETURN QUERY
        SELECT k.run_id, k.decision_id, k.attempt, x.outcome, x.request, x.response, NULL::bigint, NULL::bigint, k.decided_at, NULL::integer
        FROM (SELECT DISTINCT r FROM unnest(p_run_ids) AS r) AS ids(id)
        CROSS JOIN LATERAL (SELECT y.run_id, y.decision_id, y.attempt, y.decided_at FROM decision_keys y
                            WHERE y.run_id = ids.id ORDER BY y.attempt DESC LIMIT 1) AS k
        LEFT JOIN LATERAL (SELECT d.outcome, d.request, d.response FROM decisions d
                           WHERE d.decision_id = k.decision_id AND d.decided_at = k.decided_at LIMIT 1) AS x ON true
        ORDER BY k.run_id;
END
$$;

CREATE OR REPLACE FUNCTION budgetgate_batch_reads(p_run_ids text[])
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY SELECT r.run_id, r.decision_id, r.attempt, r.outcome, r.request, r.response, r.committed_seq, r.override_revision, r.decided_at
                 FROM budgetgate_batch_reads(p_run_ids, ARRAY[0], 1) AS r;
END
$$;

CREATE FUNCTION budgetgate_begin_decisions(p_run_ids text[], p_shards integer[], p_count integer)
RETURNS TABLE (run_id text, decision_id uuid, attempt integer, outcome text, request jsonb, response jsonb,
               committed_seq bigint, override_revision bigint, decided_at timestamptz, shard integer)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM budgetgate_lock_batch(p_run_ids, true, p_shards);
    RETURN QUERY SELECT * FROM budgetgate_batch_reads(p_run_ids, p_shards, p_count);
END
$$;

-- 0045: escrow leases of a counter tenants share (the sensitive-workload pool), on a ledger of
-- several shards (budgetgate.ledger.escrow_leases, docs/scale-out.md). A sensitive run counts on
-- its tenant's lease, a counter on its tenant's shard whose size is what that tenant's sensitive
-- runs may hold at once; the leases together never hold more than the pool's size (the bundle's).
-- A lease's use is what run_holds holds of its tenant's sensitive runs; every move is recorded in
-- escrow_moves, its ledger_key the counter's ('counter:sensitive'). The counter_pools row is what
-- every move of a pool's leases locks first, so they are made one at a time.
CREATE TABLE counter_pools (
    counter text PRIMARY KEY
);

CREATE TABLE counter_leases (
    counter text NOT NULL REFERENCES counter_pools (counter),
    root    text NOT NULL CHECK (root <> ''),
    size    bigint NOT NULL CHECK (size >= 0),
    unit    text CHECK (unit IN ('gpus', 'nodes')),
    PRIMARY KEY (counter, root)
);
