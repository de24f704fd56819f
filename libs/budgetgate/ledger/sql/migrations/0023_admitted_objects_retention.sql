-- budgetgate: no-transaction
-- 0023_admitted_objects_retention: the reconciler prunes admitted_objects of runs that ended
-- longer ago than BUDGETGATE_ADMITTED_OBJECTS_RETENTION_SECONDS, walking the rows in the order
-- they were admitted from where its last pass stopped (admitted_at, then uid for the rows of one
-- instant): this index serves that walk alone, without a sort, and makes the one on admitted_at
-- redundant. Built concurrently: the webhook records objects while it builds, and the table may
-- be large by now (nothing pruned it before). Re-runnable: a build given up leaves an invalid
-- index, dropped first.
DROP INDEX CONCURRENTLY IF EXISTS admitted_objects_admitted_at_uid;
CREATE INDEX CONCURRENTLY admitted_objects_admitted_at_uid ON admitted_objects (admitted_at, uid);
DROP INDEX CONCURRENTLY IF EXISTS admitted_objects_admitted_at;
