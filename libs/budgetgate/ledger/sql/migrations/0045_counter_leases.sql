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
    PRIMARY KEY (counter, root)
);
