-- The fulfilment saga (reserve stock -> charge -> ship -> invoice). `stock`: per tenant and
-- SKU, the quantity that can be reserved and the quantity held by reservations. A
-- reservation is one order's hold on one SKU, UNIQUE(order_id, sku): `held` until the saga
-- compensates (`released`, the quantity back in `available`) or completes (`consumed`).
-- `orders.payment_method`: the payment method the charge uses (NULL: the provider's
-- default). Timestamps are Unix ms.
CREATE TABLE IF NOT EXISTS stock (
    tenant      TEXT    NOT NULL,
    sku         TEXT    NOT NULL,
    available   BIGINT  NOT NULL CHECK (available >= 0),
    reserved    BIGINT  NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    updated_at  BIGINT  NOT NULL,
    PRIMARY KEY (tenant, sku)
);
CREATE TABLE IF NOT EXISTS stock_reservations (
    order_id    TEXT    NOT NULL,
    sku         TEXT    NOT NULL,
    tenant      TEXT    NOT NULL,
    quantity    BIGINT  NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('held', 'released', 'consumed')),
    created_at  BIGINT  NOT NULL,
    updated_at  BIGINT  NOT NULL,
    CONSTRAINT stock_reservations_order_sku UNIQUE (order_id, sku)
);
ALTER TABLE orders ADD COLUMN IF NOT EXISTS payment_method TEXT NULL;
