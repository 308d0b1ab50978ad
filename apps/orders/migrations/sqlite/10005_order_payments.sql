-- One payment per order (POST /v1/orders/{id}/payments, multi-phase): the business-level
-- guard behind the idempotency key — whichever path claims an order first charges it (the
-- endpoint, via = 'endpoint', or the billing flow's charge effect, via = 'flow'). state:
-- charging | succeeded | declined | unknown | not_charged (flow rows: flow). fence is the
-- multi-phase record's fencing token of the latest holder; attempts counts the holdings
-- that charged under the row's key.
CREATE TABLE IF NOT EXISTS order_payments (
    order_id         TEXT    PRIMARY KEY,
    tenant           TEXT    NOT NULL,
    via              TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    reference        TEXT    NOT NULL,
    provider_key     TEXT    NOT NULL,
    amount_minor     BIGINT  NOT NULL,
    currency         TEXT    NOT NULL,
    state            TEXT    NOT NULL,
    fence            BIGINT  NOT NULL,
    attempts         BIGINT  NOT NULL,
    payment_intent   TEXT,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL
);
CREATE INDEX IF NOT EXISTS order_payments_key ON order_payments (tenant, idempotency_key);
CREATE INDEX IF NOT EXISTS order_payments_created ON order_payments (created_at);
-- The evidence of each payment: every call to the provider (written before it goes out,
-- completed with its outcome) and every status check, with the fence of its holder.
CREATE TABLE IF NOT EXISTS order_payment_evidence (
    id            TEXT    PRIMARY KEY,
    order_id      TEXT    NOT NULL,
    fence         BIGINT  NOT NULL,
    kind          TEXT    NOT NULL,
    provider_key  TEXT    NOT NULL,
    started_at    BIGINT  NOT NULL,
    finished_at   BIGINT,
    outcome       TEXT    NOT NULL,
    http_status   BIGINT,
    provider_id   TEXT,
    detail        TEXT
);
CREATE INDEX IF NOT EXISTS order_payment_evidence_order ON order_payment_evidence (order_id, started_at);
