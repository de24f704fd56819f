-- 0006_quotas_pools: what runs hold at once (for hard quotas and fair share) and tokens held
-- in pools toward external services. Redis keeps live counters; these rows are the truth it is
-- rebuilt from.

CREATE TABLE run_holds (
    run_id      text PRIMARY KEY,
    decision_id uuid NOT NULL REFERENCES decisions (decision_id),
    tenant      text,
    gpus        integer NOT NULL CHECK (gpus >= 0),
    nodes       integer NOT NULL CHECK (nodes >= 0),
    sensitive   boolean NOT NULL DEFAULT false,
    state       text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz
);
CREATE INDEX run_holds_held ON run_holds (tenant) WHERE state = 'held';

CREATE TABLE pool_allocations (
    namespace        text NOT NULL,
    token            text NOT NULL,
    levels           text[] NOT NULL,   -- the declared pools it counts against, most specific first
    project          text NOT NULL DEFAULT '',
    sub_namespace    text NOT NULL DEFAULT '',
    run_id           text,              -- set when granted together with a submission
    lease_expires_at timestamptz NOT NULL,
    state            text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'released')),
    granted_at       timestamptz NOT NULL DEFAULT now(),
    released_at      timestamptz,
    PRIMARY KEY (namespace, token)
);
CREATE INDEX pool_allocations_held ON pool_allocations (namespace) WHERE state = 'held';
CREATE INDEX pool_allocations_run ON pool_allocations (run_id) WHERE run_id IS NOT NULL;
