-- The payment of an invoice (the `payments`/`charge` effect billing enqueues): when it was
-- paid (Unix ms) and the provider's object id (a PaymentIntent `pi_…`), both NULL while the
-- invoice is open; and the correlation id of the order it bills, carried into the
-- `invoice.paid` event (NULL for invoices billed before this migration).
ALTER TABLE invoices
    ADD COLUMN IF NOT EXISTS paid_at BIGINT NULL,
    ADD COLUMN IF NOT EXISTS payment_id TEXT NULL,
    ADD COLUMN IF NOT EXISTS correlation_id TEXT NULL;
