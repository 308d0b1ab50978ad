-- Operators' actions on sagas (`oncely saga retry`), MySQL 8.0+ / MariaDB 10.6+: who did
-- what to which saga, from which state to which, and on which step. Timestamps are Unix
-- milliseconds.
CREATE TABLE IF NOT EXISTS oncely_saga_audit (
    id          BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    saga_id     VARCHAR(255) CHARACTER SET ascii NOT NULL,
    at          BIGINT       NOT NULL,
    actor       VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    action      VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    from_state  VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    to_state    VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    step        VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    detail      TEXT         CHARACTER SET utf8mb4 NOT NULL,
    KEY oncely_saga_audit_saga (saga_id, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
