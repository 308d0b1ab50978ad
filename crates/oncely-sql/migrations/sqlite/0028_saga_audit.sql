-- Operators' actions on sagas (`oncely saga retry`): who did what to which saga, from which
-- state to which, and on which step. Timestamps are Unix milliseconds.
CREATE TABLE IF NOT EXISTS oncely_saga_audit (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    saga_id     TEXT    NOT NULL,
    at          BIGINT  NOT NULL,
    actor       TEXT    NOT NULL,
    action      TEXT    NOT NULL,
    from_state  TEXT    NOT NULL,
    to_state    TEXT    NOT NULL,
    step        TEXT    NOT NULL,
    detail      TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_saga_audit_saga ON oncely_saga_audit (saga_id, at);
