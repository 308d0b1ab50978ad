-- Reconciliation (docs/DESIGN.md "Multi-phase idempotency, unknown outcomes,
-- reconciliation"): what a run comparing local intents with a provider's records found,
-- the runs themselves, and operators' resolutions. Timestamps are Unix milliseconds.
-- open_slot is 1 while a discrepancy is open and NULL once resolved: the unique key holds
-- one open discrepancy per (provider, kind, reference) — NULLs are distinct — so a re-run
-- refreshes the open row instead of adding one, while resolved rows stay as history.
CREATE TABLE IF NOT EXISTS oncely_discrepancies (
    id            TEXT     PRIMARY KEY,
    provider      TEXT     NOT NULL,
    kind          TEXT     NOT NULL CHECK (kind IN ('missing_remote', 'missing_local',
        'amount_mismatch', 'status_mismatch', 'duplicate_remote')),
    reference     TEXT     NOT NULL,
    tenant        TEXT,
    effect_id     TEXT,
    provider_ids  TEXT     NOT NULL,
    details       TEXT     NOT NULL,
    run_id        TEXT     NOT NULL,
    last_run_id   TEXT     NOT NULL,
    found_at      BIGINT   NOT NULL,
    last_seen_at  BIGINT   NOT NULL,
    resolved_at   BIGINT,
    resolution    TEXT,
    resolved_by   TEXT,
    open_slot     INTEGER  DEFAULT 1 CHECK (open_slot = 1),
    UNIQUE (provider, kind, reference, open_slot)
);
CREATE INDEX IF NOT EXISTS oncely_discrepancies_open ON oncely_discrepancies (provider, found_at)
    WHERE resolved_at IS NULL;

CREATE TABLE IF NOT EXISTS oncely_reconcile_runs (
    id             TEXT     PRIMARY KEY,
    provider       TEXT     NOT NULL,
    since_ms       BIGINT   NOT NULL,
    started_at     BIGINT   NOT NULL,
    finished_at    BIGINT   NOT NULL,
    objects        INTEGER  NOT NULL,
    intents        INTEGER  NOT NULL,
    discrepancies  INTEGER  NOT NULL,
    completed      INTEGER  NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_reconcile_runs_provider
    ON oncely_reconcile_runs (provider, finished_at);

-- Operators' actions on discrepancies (oncely reconcile resolve): who, when, what, why.
CREATE TABLE IF NOT EXISTS oncely_discrepancy_audit (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    discrepancy_id  TEXT    NOT NULL,
    at              BIGINT  NOT NULL,
    actor           TEXT    NOT NULL,
    action          TEXT    NOT NULL,
    reason          TEXT    NOT NULL,
    detail          TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_discrepancy_audit_discrepancy
    ON oncely_discrepancy_audit (discrepancy_id, at);
