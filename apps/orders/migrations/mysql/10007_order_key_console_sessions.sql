-- The chain of an order (the console's order page, `orders show`): the client's
-- Idempotency-Key of the request that created the order, kept with the order itself (the
-- outbox rows that also carried it are deleted once published, the idempotency record after
-- its retention); NULL for an order created without a key or before this migration. The
-- index serves the console's search by key, always within one tenant.
ALTER TABLE orders ADD COLUMN idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL;
CREATE INDEX orders_tenant_key ON orders (tenant, idempotency_key);
CREATE INDEX orders_tenant_ref ON orders (tenant, external_ref);
-- Console sessions signed out before their expiry (POST /console/logout): the session
-- cookie's nonce, refused from then on by every instance, kept until the cookie's own expiry
-- (Unix ms), after which the MAC check refuses it anyway.
CREATE TABLE IF NOT EXISTS console_revoked_sessions (
    nonce       CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
    expires_at  BIGINT NOT NULL,
    revoked_at  BIGINT NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
