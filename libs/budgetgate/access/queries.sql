-- Named queries of budgetgate.access (budgetgate.ledger.queries.owned_by): used by that package alone.
-- Queries more than one package uses live in the shared ledger's, libs/budgetgate/ledger/sql/queries.sql.

-- name: create_api_token
INSERT INTO api_tokens (token_id, name, secret_hash, roles, namespaces, tenants, created_by, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8);

-- name: api_token_by_hash
-- A token that is neither revoked nor expired; the principal it stands for.
SELECT name, roles, namespaces, tenants, expires_at FROM api_tokens
WHERE secret_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now());

-- name: list_api_tokens
SELECT token_id, name, roles, namespaces, tenants, created_by, created_at, expires_at, revoked_at
FROM api_tokens ORDER BY created_at, name;

-- name: revoke_api_token
UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL RETURNING token_id;

-- name: admin_log
SELECT actor, action, subject, details, logged_at FROM admin_log ORDER BY id DESC LIMIT $1;

