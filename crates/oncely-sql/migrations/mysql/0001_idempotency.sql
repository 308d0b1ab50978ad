-- Idempotency records (DESIGN.md "Idempotency record"), MySQL 8.0+ / MariaDB 10.6+, InnoDB.
-- Timestamps are Unix milliseconds. Identity columns use binary collations so that keys,
-- tenants and operations compare byte for byte as on PostgreSQL and SQLite (the default
-- utf8mb4 collations are case-insensitive: "Key-A" and "key-a" would be one record).
-- `key` is a reserved word in MySQL. The primary key is at most 255*4 + 255*4 + 255 = 2,295
-- bytes (InnoDB allows 3,072).
CREATE TABLE IF NOT EXISTS oncely_idempotency (
    tenant            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    operation         VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `key`             VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    fingerprint       VARBINARY(32) NOT NULL,
    route_digest      VARBINARY(32) NOT NULL,
    state             VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    owner             VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    lease_until       BIGINT,
    response_status   INT,
    response_headers  MEDIUMTEXT   CHARACTER SET utf8mb4,
    response_body     LONGBLOB,
    created_at        BIGINT NOT NULL,
    completed_at      BIGINT,
    expires_at        BIGINT,
    PRIMARY KEY (tenant, operation, `key`),
    KEY oncely_idempotency_expires (expires_at),
    CONSTRAINT oncely_idempotency_state
        CHECK (state IN ('processing', 'succeeded', 'failed', 'unknown'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
