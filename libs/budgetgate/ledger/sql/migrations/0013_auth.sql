-- 0013_auth: authenticated callers. API tokens are kept as the SHA-256 of a high-entropy secret
-- (the secret is shown once, at creation); every administrative action is logged with who did
-- it; a pool token remembers the principal that allocated it, so only that principal (or an
-- operator) may release it.

CREATE TABLE api_tokens (
    token_id    uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    secret_hash bytea NOT NULL UNIQUE,
    roles       text[] NOT NULL CHECK (cardinality(roles) > 0),
    namespaces  text[] NOT NULL DEFAULT '{}',   -- globs; empty = every namespace
    tenants     text[] NOT NULL DEFAULT '{}',   -- empty = every tenant
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz,
    revoked_at  timestamptz
);

CREATE TABLE admin_log (
    id        bigserial PRIMARY KEY,
    actor     text NOT NULL,
    action    text NOT NULL,
    subject   text NOT NULL,
    details   jsonb NOT NULL DEFAULT '{}',
    logged_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE pool_allocations ADD COLUMN principal text;
