-- Multi-phase idempotency (DESIGN.md "Multi-phase idempotency"): a record committed as
-- 'processing' before its handler calls out holds a lease (lease_until, Unix ms, from 0001)
-- and a fencing token, raised on every take-over, so a holder whose lease ran out and whose
-- record was taken over can no longer complete it. Atomic-mode records keep fence 0.
ALTER TABLE oncely_idempotency ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
-- The lease sweep, the gauges and `oncely idempotency list --state` read records by state.
CREATE INDEX IF NOT EXISTS oncely_idempotency_state ON oncely_idempotency (state, lease_until);
