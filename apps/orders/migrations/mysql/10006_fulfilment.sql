-- The fulfilment saga (reserve stock -> charge -> ship -> invoice), MySQL 8.0+ / MariaDB
-- 10.6+. `stock`: per tenant and SKU, the quantity that can be reserved and the quantity
-- held by reservations. A reservation is one order's hold on one SKU, UNIQUE(order_id,
-- sku): `held` until the saga compensates (`released`, the quantity back in `available`) or
-- completes (`consumed`). Tenants and SKUs compare byte for byte (binary collation).
-- `orders.payment_method`: the payment method the charge uses (NULL: the provider's
-- default). Timestamps are Unix ms.
CREATE TABLE IF NOT EXISTS stock (
    tenant      VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    sku         VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    available   BIGINT       NOT NULL,
    reserved    BIGINT       NOT NULL DEFAULT 0,
    updated_at  BIGINT       NOT NULL,
    PRIMARY KEY (tenant, sku),
    CONSTRAINT stock_available CHECK (available >= 0),
    CONSTRAINT stock_reserved CHECK (reserved >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS stock_reservations (
    order_id    CHAR(36)     CHARACTER SET ascii NOT NULL,
    sku         VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    tenant      VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    quantity    BIGINT       NOT NULL,
    state       VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    created_at  BIGINT       NOT NULL,
    updated_at  BIGINT       NOT NULL,
    UNIQUE KEY stock_reservations_order_sku (order_id, sku),
    CONSTRAINT stock_reservations_state CHECK (state IN ('held', 'released', 'consumed'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
ALTER TABLE orders ADD COLUMN payment_method VARCHAR(255) CHARACTER SET utf8mb4 NULL;
