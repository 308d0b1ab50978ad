-- Idempotency records (DESIGN.md "Idempotency record"). Timestamps are Unix milliseconds.
CREATE TABLE IF NOT EXISTS oncely_idempotency (
    tenant            TEXT     NOT NULL,
    operation         TEXT     NOT NULL,
    key               TEXT     NOT NULL,
    fingerprint       BLOB     NOT NULL,
    route_digest      BLOB     NOT NULL,
    state             TEXT     NOT NULL CHECK (state IN ('processing', 'succeeded', 'failed', 'unknown')),
    owner             TEXT     NOT NULL,
    lease_until       BIGINT,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB ,
    created_at        BIGINT   NOT NULL,
    completed_at      BIGINT,
    expires_at        BIGINT,
    PRIMARY KEY (tenant, operation, key)
);
CREATE INDEX IF NOT EXISTS oncely_idempotency_expires ON oncely_idempotency (expires_at)
    WHERE expires_at IS NOT NULL;
