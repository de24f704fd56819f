-- 0016_fair_share_waiting: each tenant's GPU usage decayed with the fair-share half-life, kept by
-- the reconciler one usage change at a time (core/decay.py), read by admission for the decayed
-- share of its answers.

CREATE TABLE fair_share_usage (
    tenant            text PRIMARY KEY,
    decayed_gpu       double precision NOT NULL,   -- milli-GPU-hours, each weighted 2^(-age / half-life), as of reckoned_at
    reckoned_at       timestamptz NOT NULL,
    half_life_seconds double precision NOT NULL CHECK (half_life_seconds > 0),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
