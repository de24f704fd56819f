-- budgetgate: no-transaction
-- 0032_usage_records_observed: chargeback reports (budgetgate.reports.chargeback) read the usage
-- records observed in a period, [from, to), and of each only its run and the deltas: this index
-- finds them without reading the rest of the table, and covers what is read, so the report scans
-- the index alone (an index-only scan) once the table is vacuumed. Built concurrently: metering
-- writes usage records while it builds. Re-runnable: a build given up leaves an invalid index,
-- dropped first.
DROP INDEX CONCURRENTLY IF EXISTS usage_records_observed;
CREATE INDEX CONCURRENTLY usage_records_observed ON usage_records (observed_at) INCLUDE (run_id, gpu_milli_hours_delta, node_milli_hours_delta);
