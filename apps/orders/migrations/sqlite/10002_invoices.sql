-- Invoices created by the `billing` consumer from `order.created` events. The business-level
-- guard: one invoice per (order, kind), even for a message with a new id for the same order.
CREATE TABLE IF NOT EXISTS invoices (
    id            TEXT    PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    order_id      TEXT    NOT NULL,
    kind          TEXT    NOT NULL,
    amount_minor  BIGINT  NOT NULL,
    currency      TEXT    NOT NULL,
    message_id    TEXT    NOT NULL,
    created_at    BIGINT  NOT NULL,
    CONSTRAINT invoices_order_kind UNIQUE (order_id, kind)
);
