-- Orders of the reference service (MySQL 8.0+ / MariaDB 10.6+). Business-level uniqueness:
-- one order per (tenant, source, external_ref), whatever idempotency key the client used.
-- The business key compares byte for byte (binary collation), as on the other backends;
-- lengths are the service's validation limits (tenant 128, source 64, external_ref 128).
CREATE TABLE IF NOT EXISTS orders (
    id            CHAR(36)     CHARACTER SET ascii NOT NULL PRIMARY KEY,
    tenant        VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    source        VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    external_ref  VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    customer_id   VARCHAR(128) CHARACTER SET utf8mb4 NOT NULL,
    items         MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    amount_minor  BIGINT NOT NULL,
    currency      CHAR(3)      CHARACTER SET ascii NOT NULL,
    created_at    BIGINT NOT NULL,
    UNIQUE KEY orders_business_key (tenant, source, external_ref)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
