-- The payment of an invoice (the `payments`/`charge` effect billing enqueues): when it was
-- paid (Unix ms) and the provider's object id (a PaymentIntent `pi_…`), both NULL while the
-- invoice is open; and the correlation id of the order it bills, carried into the
-- `invoice.paid` event (NULL for invoices billed before this migration). MySQL 8.0+ /
-- MariaDB 10.6+.
ALTER TABLE invoices
    ADD COLUMN paid_at BIGINT NULL,
    ADD COLUMN payment_id VARCHAR(255) CHARACTER SET ascii NULL,
    ADD COLUMN correlation_id VARCHAR(255) CHARACTER SET utf8mb4 NULL;
