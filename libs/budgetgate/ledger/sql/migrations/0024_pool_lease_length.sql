-- 0024_pool_lease_length: the length of the lease a submission's pool token was granted with,
-- which the reconciler renews it by while the run shows it is alive (a start, a usage record).
-- Tokens granted before this have none: they are renewed by their pool's default lease.
ALTER TABLE pool_allocations ADD COLUMN lease_seconds integer CHECK (lease_seconds > 0);
