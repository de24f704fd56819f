-- 0049: the roots the Redis ledger's shards place tenants by (budgetgate.core.shards,
-- docs/scale-out.md). A tenant named here keeps its keys on its organisation's shard; any other
-- on its own. Pinned by `budgetgate ledger roots --apply` from one bundle's account tree, with
-- every process stopped, and read once by each process when it starts: the tree of a bundle
-- changes with its SHA, and two processes placing one tenant on two shards would each decide
-- alone against their own copy of its figures.
CREATE TABLE ledger_roots (
    tenant     text PRIMARY KEY CHECK (tenant <> ''),
    root       text NOT NULL CHECK (root <> ''),
    bundle_sha text NOT NULL,
    pinned_at  timestamptz NOT NULL DEFAULT now()
);
