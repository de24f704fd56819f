-- 0014_decision_readings: every decision records what it was decided on besides the submission
-- and the policy bundle, so it can be recomputed and explained later (explain, replay): each
-- ledger key's limit, reserved and consumed as the reserving script read them, the concurrency
-- readings (quota counters, pool tokens), and the outlooks a DELAY's next eligible time came
-- from (services/admission/deciding.py readings_record). Decisions recorded before this
-- migration have none and are reported as not replayable.

ALTER TABLE decisions ADD COLUMN readings jsonb;
