-- Sagas (docs/DESIGN.md "Sagas"): one row per saga and a log of its steps, forward and
-- compensating. Timestamps are Unix milliseconds. Every transition of a saga names the
-- version it read (UPDATE … WHERE version = read): two concurrent completions of one step
-- cannot both continue it.
CREATE TABLE IF NOT EXISTS oncely_sagas (
    id          TEXT    PRIMARY KEY,
    tenant      TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN
        ('running', 'compensating', 'completed', 'compensated', 'needs_review')),
    version     BIGINT  NOT NULL DEFAULT 0,
    step        BIGINT  NOT NULL DEFAULT 0,
    input       TEXT    NOT NULL,
    error       TEXT,
    deadline    BIGINT,
    created_at  BIGINT  NOT NULL,
    updated_at  BIGINT  NOT NULL
);
-- The timeout sweep: running sagas whose current step has a deadline.
CREATE INDEX IF NOT EXISTS oncely_sagas_deadline ON oncely_sagas (deadline)
    WHERE state = 'running' AND deadline IS NOT NULL;
CREATE INDEX IF NOT EXISTS oncely_sagas_tenant ON oncely_sagas (tenant, created_at);
CREATE INDEX IF NOT EXISTS oncely_sagas_state ON oncely_sagas (state, kind);

CREATE TABLE IF NOT EXISTS oncely_saga_steps (
    saga_id      TEXT    NOT NULL,
    step         BIGINT  NOT NULL,
    phase        TEXT    NOT NULL CHECK (phase IN ('forward', 'compensate')),
    name         TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN
        ('running', 'succeeded', 'failed', 'timed_out', 'needs_review')),
    attempts     BIGINT  NOT NULL DEFAULT 1,
    effect_id    TEXT,
    started_at   BIGINT  NOT NULL,
    finished_at  BIGINT,
    output       TEXT,
    evidence     TEXT,
    PRIMARY KEY (saga_id, step, phase)
);
-- A settled effect finds its step.
CREATE UNIQUE INDEX IF NOT EXISTS oncely_saga_steps_effect ON oncely_saga_steps (effect_id);
