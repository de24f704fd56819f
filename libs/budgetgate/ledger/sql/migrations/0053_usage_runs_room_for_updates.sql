-- 0053: usage_runs pages keep half their room free, so the update every poll makes to each of its
-- runs' rows (the high-water mark, the latest time, 0052's mark) fits on the row's own page: a
-- heap-only update, with no new entry in the primary key and less to vacuum. Filled to the brim,
-- each update went to another page and into the index. Pages written before this keep their fill
-- until rewritten (VACUUM FULL); new ones are half full. `budgetgate bench metering-statement
-- --rounds 3` with and without this migration, in turn: Postgres 15.4 and 15.0 µs a sample against
-- 15.9 and 16.1.
ALTER TABLE usage_runs SET (fillfactor = 50);
