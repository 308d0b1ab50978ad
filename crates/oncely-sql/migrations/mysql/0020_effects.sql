-- Outgoing effects (docs/DESIGN.md "External effects"), MySQL 8.0+ / MariaDB 10.6+: the
-- intent of a call that leaves the local transaction and its attempts with their evidence.
-- Timestamps are Unix milliseconds. Claimed by state with FOR UPDATE SKIP LOCKED and a
-- lease fenced by lease_version. Keys and references compare byte for byte.
CREATE TABLE IF NOT EXISTS oncely_effects (
    id              VARCHAR(64)  CHARACTER SET ascii NOT NULL PRIMARY KEY,
    tenant          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    provider        VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    operation       VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    reference       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    idem_key        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    key_generation  INT          NOT NULL DEFAULT 0,
    request         MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    state           VARCHAR(16)  CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    attempts        INT          NOT NULL DEFAULT 0,
    checks          INT          NOT NULL DEFAULT 0,
    available_at    BIGINT       NOT NULL,
    locked_by       VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    locked_until    BIGINT,
    lease_version   BIGINT       NOT NULL DEFAULT 0,
    provider_id     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    response        MEDIUMTEXT   CHARACTER SET utf8mb4,
    last_error      TEXT         CHARACTER SET utf8mb4,
    created_at      BIGINT       NOT NULL,
    updated_at      BIGINT       NOT NULL,
    UNIQUE KEY oncely_effects_reference (provider, operation, reference),
    UNIQUE KEY oncely_effects_key (provider, idem_key),
    KEY oncely_effects_due (state, provider, available_at),
    KEY oncely_effects_state (state, updated_at),
    CONSTRAINT oncely_effects_state_check CHECK (state IN
        ('pending', 'in_flight', 'succeeded', 'failed', 'unknown', 'absent', 'needs_review'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS oncely_effect_attempts (
    effect_id     VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    n             INT          NOT NULL,
    kind          VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    -- Evidence only (never compared), so not binary-collated: it decodes as text.
    idem_key      VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    started_at    BIGINT       NOT NULL,
    finished_at   BIGINT       NOT NULL,
    outcome       VARCHAR(32)  CHARACTER SET ascii NOT NULL,
    http_status   INT,
    provider_ids  TEXT         CHARACTER SET utf8mb4 NOT NULL,
    detail        TEXT         CHARACTER SET utf8mb4 NOT NULL,
    PRIMARY KEY (effect_id, n),
    CONSTRAINT oncely_effect_attempts_kind CHECK (kind IN ('call', 'status'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS oncely_effect_audit (
    id          BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    effect_id   VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    at          BIGINT       NOT NULL,
    actor       VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    action      VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    from_state  VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    to_state    VARCHAR(16)  CHARACTER SET ascii NOT NULL,
    detail      TEXT         CHARACTER SET utf8mb4 NOT NULL,
    KEY oncely_effect_audit_effect (effect_id, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
