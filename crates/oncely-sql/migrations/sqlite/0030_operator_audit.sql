-- Operators' actions that have no audit table of their own (the console's dead-letter
-- requeue): who, when, what on which target, and the outcome. Timestamps are Unix ms.
CREATE TABLE IF NOT EXISTS oncely_operator_audit (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      BIGINT  NOT NULL,
    actor   TEXT    NOT NULL,
    action  TEXT    NOT NULL,
    target  TEXT    NOT NULL,
    detail  TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_operator_audit_target ON oncely_operator_audit (target, at);
