-- One payment per order (POST /v1/orders/{id}/payments, multi-phase): the business-level
-- guard behind the idempotency key — whichever path claims an order first charges it (the
-- endpoint, via = 'endpoint', or the billing flow's charge effect, via = 'flow'). state:
-- charging | succeeded | declined | unknown | not_charged (flow rows: flow). fence is the
-- multi-phase record's fencing token of the latest holder; attempts counts the holdings
-- that charged under the row's key. MySQL 8.0+ / MariaDB 10.6+; the key compares byte for
-- byte (binary collation), as on the other backends.
CREATE TABLE IF NOT EXISTS order_payments (
    order_id         CHAR(36)     CHARACTER SET ascii NOT NULL PRIMARY KEY,
    tenant           VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    via              VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    idempotency_key  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    reference        VARCHAR(255) CHARACTER SET ascii NOT NULL,
    provider_key     VARCHAR(255) CHARACTER SET ascii NOT NULL,
    amount_minor     BIGINT NOT NULL,
    currency         CHAR(3)      CHARACTER SET ascii NOT NULL,
    state            VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    fence            BIGINT NOT NULL,
    attempts         BIGINT NOT NULL,
    payment_intent   VARCHAR(255) CHARACTER SET ascii NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    KEY order_payments_key (tenant, idempotency_key),
    KEY order_payments_created (created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
-- The evidence of each payment: every call to the provider (written before it goes out,
-- completed with its outcome) and every status check, with the fence of its holder.
CREATE TABLE IF NOT EXISTS order_payment_evidence (
    id            CHAR(36)     CHARACTER SET ascii NOT NULL PRIMARY KEY,
    order_id      CHAR(36)     CHARACTER SET ascii NOT NULL,
    fence         BIGINT NOT NULL,
    kind          VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    provider_key  VARCHAR(255) CHARACTER SET ascii NOT NULL,
    started_at    BIGINT NOT NULL,
    finished_at   BIGINT NULL,
    outcome       VARCHAR(32)  CHARACTER SET ascii NOT NULL,
    http_status   BIGINT NULL,
    provider_id   VARCHAR(255) CHARACTER SET ascii NULL,
    detail        TEXT         CHARACTER SET utf8mb4 NULL,
    KEY order_payment_evidence_order (order_id, started_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
