-- Reconciliation (docs/DESIGN.md "Multi-phase idempotency, unknown outcomes,
-- reconciliation"), MySQL 8.0+ / MariaDB 10.6+: what a run comparing local intents with a
-- provider's records found, the runs themselves, and operators' resolutions. Timestamps are
-- Unix milliseconds. References compare byte for byte.
-- open_slot is 1 while a discrepancy is open and NULL once resolved: the unique key holds
-- one open discrepancy per (provider, kind, reference) — NULLs are distinct — so a re-run
-- refreshes the open row instead of adding one, while resolved rows stay as history.
CREATE TABLE IF NOT EXISTS oncely_discrepancies (
    id            VARCHAR(64)  CHARACTER SET ascii NOT NULL PRIMARY KEY,
    provider      VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    kind          VARCHAR(32)  CHARACTER SET ascii NOT NULL,
    reference     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    tenant        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    effect_id     VARCHAR(64)  CHARACTER SET ascii,
    provider_ids  TEXT         CHARACTER SET utf8mb4 NOT NULL,
    details       MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    run_id        VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    last_run_id   VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    found_at      BIGINT       NOT NULL,
    last_seen_at  BIGINT       NOT NULL,
    resolved_at   BIGINT,
    resolution    VARCHAR(32)  CHARACTER SET ascii,
    resolved_by   VARCHAR(255) CHARACTER SET utf8mb4,
    open_slot     TINYINT      DEFAULT 1,
    UNIQUE KEY oncely_discrepancies_open_key (provider, kind, reference, open_slot),
    KEY oncely_discrepancies_open (provider, resolved_at, found_at),
    CONSTRAINT oncely_discrepancies_kind CHECK (kind IN ('missing_remote', 'missing_local',
        'amount_mismatch', 'status_mismatch', 'duplicate_remote')),
    CONSTRAINT oncely_discrepancies_slot CHECK (open_slot = 1)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS oncely_reconcile_runs (
    id             VARCHAR(64)  CHARACTER SET ascii NOT NULL PRIMARY KEY,
    provider       VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    since_ms       BIGINT       NOT NULL,
    started_at     BIGINT       NOT NULL,
    finished_at    BIGINT       NOT NULL,
    objects        INT          NOT NULL,
    intents        INT          NOT NULL,
    discrepancies  INT          NOT NULL,
    completed      INT          NOT NULL,
    KEY oncely_reconcile_runs_provider (provider, finished_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE IF NOT EXISTS oncely_discrepancy_audit (
    id              BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    discrepancy_id  VARCHAR(64)  CHARACTER SET ascii NOT NULL,
    at              BIGINT       NOT NULL,
    actor           VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    action          VARCHAR(32)  CHARACTER SET ascii NOT NULL,
    reason          TEXT         CHARACTER SET utf8mb4 NOT NULL,
    detail          TEXT         CHARACTER SET utf8mb4 NOT NULL,
    KEY oncely_discrepancy_audit_discrepancy (discrepancy_id, at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
