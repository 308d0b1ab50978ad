-- Invoices created by the `billing` consumer from `order.created` events (MySQL 8.0+ /
-- MariaDB 10.6+). The business-level guard: one invoice per (order, kind), even for a
-- message with a new id for the same order.
CREATE TABLE IF NOT EXISTS invoices (
    id            CHAR(36)     CHARACTER SET ascii NOT NULL PRIMARY KEY,
    tenant        VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_id      CHAR(36)     CHARACTER SET ascii NOT NULL,
    kind          VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    amount_minor  BIGINT NOT NULL,
    currency      CHAR(3)      CHARACTER SET ascii NOT NULL,
    message_id    CHAR(36)     CHARACTER SET ascii NOT NULL,
    created_at    BIGINT NOT NULL,
    UNIQUE KEY invoices_order_kind (order_id, kind)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
