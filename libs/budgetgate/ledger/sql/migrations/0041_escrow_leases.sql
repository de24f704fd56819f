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
