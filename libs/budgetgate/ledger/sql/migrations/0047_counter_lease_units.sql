-- 0047: the unit a lease of a counter tenants share is sized in (gpus or nodes, the bundle's
-- sensitive_unit when it was granted). A lease sized in another unit than the bundle's holds
-- nothing of the pool: the first grant in the new unit voids every lease of the former one on
-- every shard (budgetgate.ledger.escrow_leases), so no size is read in a unit it was not granted
-- in. Leases from before (no unit recorded) are voided the same way at their pool's next grant.
ALTER TABLE counter_leases ADD COLUMN unit text CHECK (unit IN ('gpus', 'nodes'));
