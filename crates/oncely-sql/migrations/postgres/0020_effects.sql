-- Outgoing effects (docs/DESIGN.md "External effects"): the intent of a call that leaves
-- the local transaction, recorded in the caller's transaction like an outbox row, and its
-- attempts with their evidence. Timestamps are Unix milliseconds.
-- A row is claimed by state with a lease (locked_by, locked_until, lease_version): the
-- version fences every settle, so a runner whose lease ran out cannot overwrite the work of
-- the runner that took the effect over.
CREATE TABLE IF NOT EXISTS oncely_effects (
    id              TEXT     PRIMARY KEY,
    tenant          TEXT     NOT NULL,
    provider        TEXT     NOT NULL,
    operation       TEXT     NOT NULL,
    reference       TEXT     NOT NULL,
    idem_key        TEXT     NOT NULL,
    key_generation  INTEGER  NOT NULL DEFAULT 0,
    request         TEXT     NOT NULL,
    state           TEXT     NOT NULL DEFAULT 'pending' CHECK (state IN
        ('pending', 'in_flight', 'succeeded', 'failed', 'unknown', 'absent', 'needs_review')),
    attempts        INTEGER  NOT NULL DEFAULT 0,
    checks          INTEGER  NOT NULL DEFAULT 0,
    available_at    BIGINT   NOT NULL,
    locked_by       TEXT,
    locked_until    BIGINT,
    lease_version   BIGINT   NOT NULL DEFAULT 0,
    provider_id     TEXT,
    response        TEXT,
    last_error      TEXT,
    created_at      BIGINT   NOT NULL,
    updated_at      BIGINT   NOT NULL,
    UNIQUE (provider, operation, reference),
    UNIQUE (provider, idem_key)
);
-- Due work: every row that is not finished, by when it is due.
CREATE INDEX IF NOT EXISTS oncely_effects_due ON oncely_effects (provider, available_at)
    WHERE state IN ('pending', 'in_flight', 'unknown', 'absent');
CREATE INDEX IF NOT EXISTS oncely_effects_state ON oncely_effects (state, updated_at);

CREATE TABLE IF NOT EXISTS oncely_effect_attempts (
    effect_id     TEXT     NOT NULL,
    n             INTEGER  NOT NULL,
    kind          TEXT     NOT NULL CHECK (kind IN ('call', 'status')),
    idem_key      TEXT     NOT NULL,
    started_at    BIGINT   NOT NULL,
    finished_at   BIGINT   NOT NULL,
    outcome       TEXT     NOT NULL,
    http_status   INTEGER,
    provider_ids  TEXT     NOT NULL,
    detail        TEXT     NOT NULL,
    PRIMARY KEY (effect_id, n)
);

-- Operator resolutions (oncely effects resolve / retry): who did what, when, and why.
CREATE TABLE IF NOT EXISTS oncely_effect_audit (
    id          BIGSERIAL PRIMARY KEY,
    effect_id   TEXT    NOT NULL,
    at          BIGINT  NOT NULL,
    actor       TEXT    NOT NULL,
    action      TEXT    NOT NULL,
    from_state  TEXT    NOT NULL,
    to_state    TEXT    NOT NULL,
    detail      TEXT    NOT NULL
);
