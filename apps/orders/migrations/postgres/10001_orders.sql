-- Orders of the reference service. Business-level uniqueness: one order per
-- (tenant, source, external_ref), whatever idempotency key the client used.
CREATE TABLE IF NOT EXISTS orders (
    id            TEXT    PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    source        TEXT    NOT NULL,
    external_ref  TEXT    NOT NULL,
    customer_id   TEXT    NOT NULL,
    items         TEXT    NOT NULL,
    amount_minor  BIGINT  NOT NULL,
    currency      TEXT    NOT NULL,
    created_at    BIGINT  NOT NULL,
    CONSTRAINT orders_business_key UNIQUE (tenant, source, external_ref)
);
