-- 0021_unique_ledger_seq: no two decisions record the same ledger sequence number. Redis hands
-- every reserving decision the next number, and admission decides only on a Redis whose number
-- is not behind the highest Postgres committed. A Redis that lost a write it had acknowledged (a
-- failover to a replica that never got it) hands that number out again, to a batch that read the
-- highest before the first batch committed: both commit it, Redis's number then matches
-- Postgres's, and the reservation Redis lost goes unnoticed (room admitted twice). With the
-- number unique the second commit fails, and admission rebuilds Redis from Postgres and decides
-- that batch again.
-- A database that already holds such pairs keeps them (they are history); the unique index then
-- covers the numbers above the highest of them, beside a plain one for reading the highest, and a
-- warning says so.
DO $$
DECLARE
    highest bigint;
    reused bigint;
BEGIN
    SELECT max(d.ledger_seq), count(*) INTO highest, reused
    FROM (SELECT ledger_seq FROM decisions WHERE ledger_seq IS NOT NULL GROUP BY ledger_seq HAVING count(*) > 1) AS d;
    DROP INDEX decisions_ledger_seq;
    IF highest IS NULL THEN
        CREATE UNIQUE INDEX decisions_ledger_seq ON decisions (ledger_seq) WHERE ledger_seq IS NOT NULL;
    ELSE
        RAISE WARNING '% ledger sequence number(s) are recorded by more than one decision, the highest %: a Redis that lost reservations was decided on before this migration; numbers above it are unique from now on', reused, highest;
        EXECUTE format('CREATE UNIQUE INDEX decisions_ledger_seq ON decisions (ledger_seq) WHERE ledger_seq > %s', highest);
        CREATE INDEX decisions_ledger_seq_reused ON decisions (ledger_seq) WHERE ledger_seq IS NOT NULL;
    END IF;
END
$$;
