-- Sagas (docs/DESIGN.md "Sagas"), MySQL 8.0+ / MariaDB 10.6+: one row per saga and a log
-- of its steps, forward and compensating. Timestamps are Unix milliseconds. Every
-- transition of a saga names the version it read (UPDATE … WHERE version = read): two
-- concurrent completions of one step cannot both continue it. Tenants compare byte for byte.
CREATE TABLE IF NOT EXISTS oncely_sagas (
    id          VARCHAR(255) CHARACTER SET ascii NOT NULL PRIMARY KEY,
    tenant      VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    kind        VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    state       VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    version     BIGINT       NOT NULL DEFAULT 0,
    step        BIGINT       NOT NULL DEFAULT 0,
    input       MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    error       TEXT         CHARACTER SET utf8mb4,
    deadline    BIGINT,
    created_at  BIGINT       NOT NULL,
    updated_at  BIGINT       NOT NULL,
    KEY oncely_sagas_deadline (state, deadline),
    KEY oncely_sagas_tenant (tenant, created_at),
    KEY oncely_sagas_state (state, kind),
    CONSTRAINT oncely_sagas_state_check CHECK (state IN
        ('running', 'compensating', 'completed', 'compensated', 'needs_review'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS oncely_saga_steps (
    saga_id      VARCHAR(255) CHARACTER SET ascii NOT NULL,
    step         BIGINT       NOT NULL,
    phase        VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    name         VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    state        VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    attempts     BIGINT       NOT NULL DEFAULT 1,
    effect_id    VARCHAR(64)  CHARACTER SET ascii,
    started_at   BIGINT       NOT NULL,
    finished_at  BIGINT,
    output       MEDIUMTEXT   CHARACTER SET utf8mb4,
    evidence     TEXT         CHARACTER SET utf8mb4,
    PRIMARY KEY (saga_id, step, phase),
    UNIQUE KEY oncely_saga_steps_effect (effect_id),
    CONSTRAINT oncely_saga_steps_phase CHECK (phase IN ('forward', 'compensate')),
    CONSTRAINT oncely_saga_steps_state CHECK (state IN
        ('running', 'succeeded', 'failed', 'timed_out', 'needs_review'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
