-- Operators' actions that have no audit table of their own (the console's dead-letter
-- requeue): who, when, what on which target, and the outcome. Timestamps are Unix ms.
CREATE TABLE IF NOT EXISTS oncely_operator_audit (
    id      BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    at      BIGINT       NOT NULL,
    actor   VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    action  VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    target  VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    detail  TEXT         CHARACTER SET utf8mb4 NOT NULL,
    KEY oncely_operator_audit_target (target, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
