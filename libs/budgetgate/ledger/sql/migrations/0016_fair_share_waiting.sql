-- 0016_fair_share_waiting: each tenant's GPU usage decayed with the fair-share half-life, kept by
-- the reconciler one usage change at a time (core/decay.py), read by admission for the decayed
-- share of its answers; and the runs waiting for budget or quota headroom.

CREATE TABLE fair_share_usage (
    tenant            text PRIMARY KEY,
    decayed_gpu       double precision NOT NULL,   -- milli-GPU-hours, each weighted 2^(-age / half-life), as of reckoned_at
    reckoned_at       timestamptz NOT NULL,
    half_life_seconds double precision NOT NULL CHECK (half_life_seconds > 0),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Runs refused for now (a DELAY waits for budget, a concurrency rejection for quota headroom),
-- registered by the reconciler from budget.decisions.v1 and forgotten when the run is decided
-- again or ends; when room returns for one, a HEADROOM action goes out (once per cause).
CREATE TABLE waiting_runs (
    run_id        text PRIMARY KEY,
    attempt       integer NOT NULL,
    decision_id   uuid NOT NULL UNIQUE,
    waiting_for   text NOT NULL CHECK (waiting_for IN ('budget', 'quota')),
    tenant        text,
    labels        jsonb NOT NULL,
    sensitive     boolean NOT NULL,       -- counted against the sensitive pool when registered
    gpus          integer NOT NULL,
    nodes         integer NOT NULL,
    needs         jsonb NOT NULL,         -- [[policy id, unit, amount], ...] of the budgets that refused it
    policy_ids    text[] NOT NULL,        -- the same policies, for finding the runs a release concerns
    checked_sha   text,                   -- the policy bundle it was last judged under
    decided_at    timestamptz NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX waiting_runs_tenant ON waiting_runs (tenant) WHERE waiting_for = 'quota';
CREATE INDEX waiting_runs_policies ON waiting_runs USING gin (policy_ids);

-- The HEADROOM actions sent: one per waiting decision and cause (the event that freed room).
CREATE TABLE headroom_notices (
    decision_id uuid NOT NULL,
    cause       text NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (decision_id, cause)
);
