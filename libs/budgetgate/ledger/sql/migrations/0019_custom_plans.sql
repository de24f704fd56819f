-- 0019_custom_plans: the batch functions plan their statements for each call. PL/pgSQL caches a
-- statement's plan per connection and, after five calls, keeps a generic plan when it costs no
-- more than the custom ones did; on a new database those first calls see empty tables, so the
-- kept plan scans them in full, and it stays until an ANALYZE of the table, which autovacuum
-- does only after its naptime and thresholds. Meanwhile every batch read the whole decisions
-- table (measured: `bench admission --open-loop-rate 700` went from p50 12 ms to 60 ms in 40 s,
-- 2,962 sequential scans of decisions reading 19 million rows). A custom plan costs tens of
-- microseconds per batch, and always sees the tables as they are.
ALTER FUNCTION budgetgate_begin_batch(text[]) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION metering_begin_sample(text, text, timestamptz) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION metering_begin_batch(text[], text[], timestamptz[]) SET plan_cache_mode = force_custom_plan;
ALTER FUNCTION metering_place_batch(text[], text[], timestamptz[], bigint[], bigint[], text[], text[], text[]) SET plan_cache_mode = force_custom_plan;
